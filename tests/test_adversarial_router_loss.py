"""RingTrainer and models that add terms of their own to their loss (MoE router losses, a z-loss).

The stock Trainer's loss for an MoE model (Mixtral with ``output_router_logits=True``) is
the cross-entropy plus ``router_aux_loss_coef * aux_loss``; RingTrainer computed the
cross-entropy alone, a silently different loss and gradient (found by adversarial testing:
4.16 against 5.16 on a two-layer version of the model below). It must refuse, naming the setting, and still
train the same model with the auxiliary loss off. One process, no CP: the refusal does not
depend on cp_size.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (BambaConfig, BambaForCausalLM, JetMoeConfig, JetMoeForCausalLM, MixtralConfig,
                          MixtralForCausalLM, TrainingArguments)

from hf_ring import RingTrainer


def _model(output_router_logits: bool) -> MixtralForCausalLM:
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=output_router_logits,
                           router_aux_loss_coef=0.5, use_cache=False)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def test_router_aux_loss_is_refused_not_dropped(tmp_path):
    model = _model(True)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    # What the stock Trainer would optimise differs from the cross-entropy by the aux term
    # (0.5 x ~2 here; any difference above float32 rounding shows it is not dropped harmlessly).
    with torch.no_grad():
        with_aux = model(input_ids=ids, labels=ids).loss
        model.config.output_router_logits = False
        without = model(input_ids=ids, labels=ids).loss
        model.config.output_router_logits = True
    assert abs(with_aux.item() - without.item()) > 1e-3
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(NotImplementedError, match=r"output_router_logits=True.*router_aux_loss_coef"):
        RingTrainer(model=model, args=args)
    RingTrainer(model=_model(False), args=args)  # the auxiliary loss off: accepted


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
