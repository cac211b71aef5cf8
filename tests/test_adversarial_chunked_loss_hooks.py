"""The chunked loss and a forward hook on the LM head.

The chunked loss swaps the head's forward for a recorder and recomputes the logits itself,
so a forward hook on the head (which may change the logits: here it scales them by 3) ran
on an empty tensor and its result was dropped: a silently different loss (found by
adversarial testing: 38.71 against 38.26). It must refuse, naming the hooks and how to
turn the chunked loss off; without the hook it still matches the full computation.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
from hf_ring.training.loss import token_loss_sum


def test_a_head_with_forward_hooks_is_refused():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)).double()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 50, (1, 10), generator=g), torch.randint(0, 50, (1, 10), generator=g)
    config = ChunkedLossConfig(True, 4)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out * 3.0)
    with pytest.raises(NotImplementedError, match="forward hooks.*chunked_loss=False"):
        model_token_loss_sum(model, model, {"input_ids": ids}, labels, config)
    assert "forward" not in vars(model.lm_head)  # refused before the head was touched
    handle.remove()
    got, _ = model_token_loss_sum(model, model, {"input_ids": ids}, labels, config)
    # float64: the chunks' sums in another order differ by a few ulps only.
    assert torch.allclose(got.double(), token_loss_sum(model(input_ids=ids).logits, labels).double(), rtol=1e-6)
