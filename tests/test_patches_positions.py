"""``hf_ring.patches.transformers``' readers of what transformers computes from positions
outside the attention function (``rope.py``, ``temperature.py``), in one process on CPU.

As in test_patches: each refuses a version it was not written for, refuses a module whose
forward is not the one it was written for, and does its job on the installed classes: a
length-dependent rotary handed the sequence's largest position gives a shard's positions
exactly the cos / sin of the full sequence; Llama 4's temperature is read from its layer.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

from hf_ring.patches import transformers as tf_patches

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5.0.0.dev0")


def _dynamic_rotary() -> LlamaRotaryEmbedding:
    """Dynamic NTK RoPE over 16-dim heads, recomputed from 8 positions on."""
    rope = ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}} if TRANSFORMERS_5
            else {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    config = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=8, **rope)
    return LlamaRotaryEmbedding(config)


def _llama4_attention(layer: int) -> Llama4TextAttention:
    config = AutoConfig.for_model(
        "llama4_text", hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=2, no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
    )
    return Llama4TextAttention(config, layer)


def test_position_readers_refuse_an_installed_version_they_do_not_know(monkeypatch):
    rotary, attention = _dynamic_rotary(), _llama4_attention(1)
    import transformers as installed  # the module object now (importing models can replace it)

    monkeypatch.setattr(installed, "__version__", "4.56.2")
    for call in (lambda: tf_patches.reads_max_position(rotary), lambda: tf_patches.query_temperature(attention)):
        with pytest.raises(tf_patches.UnsupportedTransformersVersion, match="transformers 4.56.2"):
            call()


def test_a_shard_handed_the_largest_position_gets_the_full_sequence_frequencies():
    x = torch.zeros(1, 16, 64)
    full = _dynamic_rotary()(x, torch.arange(16)[None])  # recomputed for 16 positions
    shard = torch.arange(4, 12)[None]  # the largest position a shard holds: 11, below 16
    rotary = _dynamic_rotary()
    assert tf_patches.length_dependent_rope(rotary) and tf_patches.reads_max_position(rotary)
    tf_patches.hand_max_position(rotary)
    tf_patches.set_max_position(rotary, 15)
    for got, want in zip(rotary(x[:, :8], shard), full):
        assert got.shape == (1, 8, 16) and torch.equal(got, want[:, 4:12])
    # None: the rotary reads its own positions, as transformers does (a fresh one: dynamic
    # NTK keeps the frequencies it grew to until a call falls below 8 positions).
    fresh = _dynamic_rotary()
    tf_patches.hand_max_position(fresh)
    tf_patches.set_max_position(fresh, None)
    assert not torch.equal(fresh(x[:, :8], shard)[0], full[0][:, 4:12])


def test_rotaries_that_do_not_read_the_length_are_left_alone():
    rotary = _dynamic_rotary()
    rotary.rope_type = "default"
    assert not tf_patches.reads_max_position(rotary)
    own = type("OwnRotary", (torch.nn.Module,), {"rope_type": "dynamic", "forward": lambda self, x, p: x})()
    assert tf_patches.length_dependent_rope(own) and not tf_patches.reads_max_position(own)
    with pytest.raises(RuntimeError, match="hand_max_position first"):
        tf_patches.set_max_position(_dynamic_rotary(), 15)


def test_llama4_temperature_is_read_from_its_nope_layers():
    assert tf_patches.query_temperature(_llama4_attention(1)) == (4.0, 0.5)
    assert tf_patches.query_temperature(_llama4_attention(0)) is None  # a RoPE layer
    scales = tf_patches.temperature_scale(torch.tensor([0, 2, 3, 7, 15]), 4.0, 0.5)
    assert torch.allclose(scales, 1 + 0.5 * torch.log1p(torch.tensor([0.0, 0.0, 1.0, 2.0, 4.0])))


def test_temperature_computed_another_way_is_refused():
    attention = _llama4_attention(1)
    attention.__class__ = type("OtherAttention", (Llama4TextAttention,), {"forward": lambda self, *a, **k: None})
    with pytest.raises(tf_patches.UnsupportedTransformersVersion, match="OtherAttention.forward"):
        tf_patches.query_temperature(attention)
