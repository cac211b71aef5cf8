"""RingTrainer and models that add terms of their own to their loss (MoE router losses, a z-loss).

The stock Trainer's loss for an MoE model (Mixtral with ``output_router_logits=True``) is
the cross-entropy plus ``router_aux_loss_coef * aux_loss``; RingTrainer once computed the
cross-entropy alone, a silently different loss and gradient (found by adversarial testing:
4.16 against 5.16 on a two-layer version of the model below). Now it adds the term as the
stock model does, over the CP group's whole sequence (tests/test_moe_cp.py under CP), and
refuses what it cannot reproduce, naming the setting. One process here: the loss and the
refusals do not depend on cp_size.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (BambaConfig, BambaForCausalLM, JetMoeConfig, JetMoeForCausalLM, MixtralConfig,
                          MixtralForCausalLM, TrainingArguments)

from hf_ring import RingAttentionPlugin, RingTrainer


def _model(output_router_logits: bool) -> MixtralForCausalLM:
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=output_router_logits,
                           router_aux_loss_coef=0.5, use_cache=False)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def test_router_aux_loss_is_added_as_the_stock_model_adds_it(tmp_path):
    """RingTrainer's loss on a padded batch with the collator's attention_mask equals the
    model's own (cross-entropy mean + 0.5 x aux, padding out of both), within float32
    rounding (1e-6 relative); the term is not small (0.5 x ~2)."""
    model = _model(True)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    plugin = RingAttentionPlugin(cp_size=1)
    trainer = RingTrainer(model=model, args=args, ring_plugin=plugin)
    rows = [{"input_ids": list(range(3, 13))}, {"input_ids": list(range(20, 26))}]
    batch = plugin.make_collator(0, return_attention_mask=True)(rows)
    stock_labels = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    with torch.no_grad():
        stock = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=stock_labels)
        ours = trainer.compute_loss(model, dict(batch))
        without_aux = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=stock_labels,
                            output_router_logits=False).loss
    assert abs(ours.item() - stock.loss.item()) < 1e-6 * stock.loss.item(), (ours.item(), stock.loss.item())
    assert abs(stock.loss.item() - without_aux.item()) > 0.1  # the term weighs in
    with pytest.raises(ValueError, match="return_attention_mask=True"):
        trainer.compute_loss(model, dict(plugin.make_collator(0)(rows)))
    with pytest.raises(NotImplementedError, match="packed rows"):
        trainer.compute_loss(model, dict(plugin.make_collator(0, packing=True)(rows)))
    for collator in (plugin.make_collator(0), plugin.make_collator(0, packing=True)):  # refused before any step
        with pytest.raises(ValueError, match="make_collator\\(..., packing=False, return_attention_mask=True\\)"):
            RingTrainer(model=model, args=args, ring_plugin=plugin, data_collator=collator)
    RingTrainer(model=_model(False), args=args)  # the auxiliary loss off: nothing to add


def test_other_loss_terms_are_refused(tmp_path):
    """JetMoE names its coefficient aux_loss_coef; Bamba adds a z-loss when labels are given."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    jetmoe = JetMoeForCausalLM(JetMoeConfig(**small, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=True, aux_loss_coef=0.1))
    with pytest.raises(NotImplementedError, match="output_router_logits=True"):
        RingTrainer(model=jetmoe, args=args)
    bamba = BambaForCausalLM(BambaConfig(**small, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                         attn_layer_indices=[0], z_loss_coefficient=0.1))
    with pytest.raises(NotImplementedError, match="z_loss_coefficient"):
        RingTrainer(model=bamba, args=args)
