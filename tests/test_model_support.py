"""hf_ring.hf.support: models the ring cannot run exactly are refused by reading the
model (its modules and config), never run silently wrong (issue 10 items 1-2).

One tiny random model per refused feature (hidden 32, 2 layers, vocab 128), built in this
process from ``AutoConfig.for_model``; ``check_model_under_cp`` is called directly (no
process group: it reads only the model and the forward's lengths). Each refusal must
name the feature (module path and class, or config field) so that a user knows what to
change; each length-dependent rule is checked on both sides of its bound, because a
bound off by one either refuses a model that is exact or runs one that is not. Plain
transformer families (dense, MoE, GPT-2's per-token Conv1D) must not be refused.
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_ring.hf.support import detectors, windows
from hf_ring.hf.support import check_model_supported, check_model_under_cp
from hf_ring.patches.transformers import reads_max_position
from test_hf_attention import _COMMON

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5.0.0.dev0")
CP = 2
SEQ = 64  # a forward's full row length, far below every default window and RoPE threshold

# test_hf_attention's tiny config (2 layers, 4 heads over 2 KV heads, vocab 128), narrower.
_TINY = {**_COMMON, "hidden_size": 32, "intermediate_size": 64}


def tiny(model_type: str, attn_implementation: Optional[str] = None, **overrides) -> PreTrainedModel:
    """A tiny random causal LM of ``model_type`` (weights do not matter: nothing runs)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**_TINY, **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "fast path not available" for Mamba kernels
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def rope(**parameters) -> dict:
    """RoPE parameters as the installed transformers takes them (5.x: rope_parameters with
    rope_theta inside; 4.57: rope_scaling)."""
    if TRANSFORMERS_5:
        return {"rope_parameters": {"rope_theta": 10000.0, **parameters}}
    return {"rope_scaling": parameters}


def refusal(model, seq_len: int = SEQ, cp_size: int = CP, doc_lens=None) -> str:
    """The refusal's message, or "" when the model is accepted."""
    try:
        check_model_under_cp(model, cp_size, seq_len, doc_lens=doc_lens)
    except NotImplementedError as e:
        return str(e)
    return ""


# --- token mixers other than attention: refused whatever the length -------------------


@pytest.mark.parametrize(
    "model_type, overrides, names",
    [
        # LFM2's short convolution layer (layer_types "conv"): a depthwise Conv1d over time.
        ("lfm2", dict(layer_types=["conv", "full_attention"]), ["layers.0.conv", "Lfm2ShortConv"]),
        # GraniteMoeHybrid's Mamba-2 layers: A_log / dt_bias parameters and a Conv1d.
        (
            "granitemoehybrid",
            dict(
                layer_types=["mamba", "attention"],
                mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
            ),
            ["layers.0.mamba", "GraniteMoeHybridMambaLayer", "A_log"],
        ),
        # Qwen3-Next's gated delta-net (linear attention) layers: routed to hf_ring's CP
        # mixers on transformers 5 (test_gated_delta_nets_are_routed_on_transformers_5).
        *([] if TRANSFORMERS_5 else [("qwen3_next", dict(head_dim=8), ["linear_attn", "Qwen3NextGatedDeltaNet"])]),
        # RWKV: time mixing through decay and token-shift coefficients, no convolution at all.
        ("rwkv", dict(), ["blocks.0.attention", "RwkvSelfAttention", "time_decay"]),
    ],
)
def test_token_mixers_other_than_attention_are_refused(model_type, overrides, names):
    message = refusal(tiny(model_type, **overrides))
    # Refused even on a short sequence: a shard sees only its own tokens at any length.
    assert "mix tokens along the sequence without attention" in message, message
    for name in names:
        assert name in message, (name, message)
    assert f"cp_size={CP}" in message, message


@pytest.mark.skipif(not TRANSFORMERS_5, reason="the gated delta nets are routed on transformers 5 only")
def test_gated_delta_nets_are_routed_on_transformers_5():
    # Exact under CP (tests/test_hf_hybrid.py), so not refused: neither at cp > 1 nor on packed
    # rows. Routing happens when a model asks for ring_flash (its layers are guarded).
    model = tiny("qwen3_next", attn_implementation="ring_flash", head_dim=8)
    assert refusal(model) == ""
    assert refusal(model, cp_size=1, doc_lens=[32, 32]) == ""


def test_token_mixers_are_refused_on_packed_rows_without_cp():
    # Without CP the ring still runs on packed rows, where a convolution would reach across
    # document boundaries: refused there too, saying where.
    message = refusal(tiny("lfm2", layer_types=["conv", "full_attention"]), cp_size=1, doc_lens=[32, 32])
    assert "on packed rows" in message and "Lfm2ShortConv" in message, message


@pytest.mark.skipif("deepseek_v32" not in CONFIG_MAPPING, reason="DeepSeek-V3.2 is not in this transformers")
def test_layer_types_the_ring_does_not_compute_are_refused():
    # DeepSeek-V3.2's indexed (top-k sparse) attention: the attention interface is used,
    # but the indexer would select keys from the local shard; read from config.layer_types.
    message = refusal(tiny("deepseek_v32"))
    assert "config.layer_types" in message and "indexed_attention" in message, message


# --- RoPE whose frequencies depend on the sequence length ---------------------------


def _longrope_phi3():
    factors = dict(short_factor=[1.0] * 4, long_factor=[2.0] * 4)
    if TRANSFORMERS_5:
        parameters = rope(rope_type="longrope", original_max_position_embeddings=64, **factors)
    else:  # 4.57's Phi-3 config wants exactly these three fields
        parameters = {"rope_scaling": {"type": "longrope", **factors}}
    return tiny("phi3", original_max_position_embeddings=64, **parameters)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_transformers_length_dependent_rope_is_handed_the_sequence_length(kind):
    # transformers' dynamic_rope_update picks the frequencies from max(position_ids) + 1;
    # the guard hands its rotaries the sequence's largest position, so no length is bounded
    # (exactness: test_hf_sequence_features).
    model = tiny("llama", **rope(rope_type="dynamic", factor=2.0)) if kind == "dynamic" else _longrope_phi3()
    assert reads_max_position(model.model.rotary_emb)
    assert refusal(model, seq_len=4096) == ""
    assert refusal(model, seq_len=4096, doc_lens=[2000, 2096]) == ""
    assert refusal(model, seq_len=4096, cp_size=1, doc_lens=[2000, 2096]) == ""


class _OwnRotary(torch.nn.Module):
    """A family's own rotary embedding with a length-dependent rope_type, which transformers'
    dynamic_rope_update does not drive (so nothing hands it the sequence's length)."""

    rope_type = "dynamic"

    def forward(self, x, position_ids):
        return x, x


def test_length_dependent_rope_of_another_rotary_is_bounded_from_max_position_embeddings_on():
    # Dynamic NTK recomputes the frequencies once max(position_ids) + 1 reaches
    # max_position_embeddings (256): below it no rank recomputes, from it on each rank
    # would pick its own.
    model = tiny("llama", **rope(rope_type="dynamic", factor=2.0))
    model.model.rotary_emb = _OwnRotary()
    assert refusal(model, seq_len=255) == ""
    message = refusal(model, seq_len=256)
    assert "rope_type='dynamic'" in message and "at most 255 tokens" in message, message
    assert "not transformers' dynamic_rope_update" in message, message
    # Packed rows: positions restart per document, so the longest document counts.
    assert refusal(model, seq_len=400, doc_lens=[200, 200]) == ""
    assert "rope_type='dynamic'" in refusal(model, seq_len=400, doc_lens=[256, 144])


@pytest.mark.skipif(not TRANSFORMERS_5, reason="per-layer-type rope_parameters are transformers 5")
def test_dynamic_rope_in_a_per_layer_type_dict_is_handed_the_sequence_length():
    per_type = {
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    gemma3 = dict(head_dim=8, rope_parameters=per_type, layer_types=["sliding_attention", "full_attention"])
    model = tiny("gemma3_text", **gemma3)
    assert reads_max_position(model.model.rotary_emb)
    assert refusal(model, seq_len=4096) == ""
    model = tiny("gemma3_text", **gemma3)
    model.model.rotary_emb = _OwnRotary()
    message = refusal(model, seq_len=256)
    assert "config.rope_parameters['full_attention']" in message and "'dynamic'" in message, message


# --- windows and chunks that live in the config (and the mask) only -----------------


@pytest.mark.parametrize(
    "model_type, overrides, layers",
    [
        # Qwen2-MoE applies its window through the mask only (its attention passes none),
        # on the layers config.layer_types makes sliding (0 of 2 with max_window_layers=2).
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2), {0: 16}),
        # PhiMoE likewise, on every layer (no layer_types).
        ("phimoe", dict(sliding_window=16), {0: 16, 1: 16}),
        # Mistral and Qwen2 pass their window to the attention function: nothing to hand.
        ("mistral", dict(sliding_window=16), {}),
        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), {}),
    ],
)
def test_sliding_windows_are_computed_on_dense_and_packed_rows(model_type, overrides, layers):
    model = tiny(model_type, **overrides)
    if TRANSFORMERS_5:  # 4.57's Qwen2-MoE and PhiMoE pick their attention class from a table: refused
        assert detectors.handed_to_the_ring(model).windows == layers
    # Dense rows: the ring computes the window (handed down where the mask alone applies it).
    assert refusal(model, seq_len=17) == ""
    assert refusal(model, seq_len=4096) == ""
    # Packed rows: the ring computes it inside each document (tests/test_ring_packed_window.py;
    # a whole model: test_hf_attention_distributed.py).
    assert refusal(model, seq_len=48, doc_lens=[16, 16, 16]) == ""
    assert refusal(model, seq_len=96, doc_lens=[40, 40, 16]) == ""


@pytest.mark.skipif(not TRANSFORMERS_5, reason="4.57's Qwen2-MoE attention has no sliding_window attribute")
def test_mask_only_windows_are_told_apart_by_the_call():
    # Qwen2-MoE sets a sliding_window attribute on its attention but never passes it.
    model = tiny("qwen2_moe", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert model.model.layers[0].self_attn.sliding_window == 16
    assert windows.mask_windows(model.config, list(model.model.named_modules())) == {0: 16}


def test_llama4_chunked_attention_is_computed_on_dense_rows_refused_on_packed_rows_past_the_chunk():
    model = tiny(
        "llama4_text", head_dim=8, num_local_experts=2, intermediate_size_mlp=64,
        attention_chunk_size=32, attn_temperature_tuning=False, no_rope_layers=[1, 0],
    )
    # Query i sees key j when both are in the same 32-token chunk of the row: handed to the
    # ring on the chunked layers (layer 0 uses RoPE and chunks, layer 1 neither).
    assert detectors.handed_to_the_ring(model).chunks == {0: 32}
    assert refusal(model, seq_len=4096) == ""
    # Packed rows: not computed yet, and a chunk boundary cuts a document wherever it falls
    # in the row, so the row counts, not its longest document.
    assert refusal(model, seq_len=32, doc_lens=[16, 16]) == ""
    message = refusal(model, seq_len=34, doc_lens=[16, 18])
    assert "config.attention_chunk_size=32" in message and "packed row has 34 tokens" in message, message


_LLAMA4_TEMPERATURE = dict(
    head_dim=8, num_local_experts=2, intermediate_size_mlp=64, no_rope_layers=[1, 0], floor_scale=32,
    attention_chunk_size=1024,
)


def test_llama4_temperature_tuning_is_rescaled_by_the_ring():
    # Layer 1 is a NoPE layer (no_rope_layers[1] == 0): its queries are scaled by
    # log1p(floor((p + 1) / 32)) * attn_scale + 1 with p the local token index, which the
    # ring rescales to the global one (exactness: test_hf_sequence_features).
    model = tiny("llama4_text", **_LLAMA4_TEMPERATURE)
    assert detectors.handed_to_the_ring(model).temperatures == {1: (32.0, 0.1)}
    assert refusal(model, seq_len=1024) == ""
    assert refusal(model, seq_len=64, cp_size=1, doc_lens=[32, 32]) == ""


def test_llama4_temperature_computed_another_way_is_refused_where_it_scales():
    # A layer whose forward is not the one hf_ring read: bounded where the scale is 1
    # (every p + 1 < 32: rows of up to 31 tokens).
    model = tiny("llama4_text", **_LLAMA4_TEMPERATURE)
    layer = model.model.layers[1].self_attn
    layer.__class__ = type("OtherAttention", (type(layer),), {"forward": lambda self, *a, **k: None})
    assert detectors.handed_to_the_ring(model).temperatures == {}
    assert refusal(model, seq_len=31) == ""
    message = refusal(model, seq_len=32)
    assert "temperature tuning" in message and "NoPE layers 1" in message, message
    # The whole row counts (positions run over the row, not per document).
    assert "temperature tuning" in refusal(model, seq_len=32, cp_size=1, doc_lens=[16, 16])


# --- V head size different from Q/K's -----------------------------------------------


_MLA = dict(
    qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=16, q_lora_rank=None,
    n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=2,
)


def test_multi_head_latent_attention_is_not_refused():
    # Value heads of another size than Q/K's (16 against 16 + 8) run in every pattern on
    # padded kernel heads (tests/test_cp_patterns.py, tests/test_value_heads.py).
    assert refusal(tiny("deepseek_v3", v_head_dim=16, **_MLA)) == ""
    assert refusal(tiny("deepseek_v3", v_head_dim=16, **_MLA), cp_size=1, doc_lens=[32, 32]) == ""
    assert refusal(tiny("deepseek_v3", v_head_dim=24, **_MLA)) == ""


# --- attention that does not go through transformers' attention interface -----------


# Falcon picked its attention class from FALCON_ATTENTION_CLASSES up to transformers 5.24;
# 5.25 moved it onto the attention interface (tests/test_patches.py reads both).
FALCON_ON_INTERFACE = Version(transformers.__version__) >= Version("5.25.0")


def test_a_model_with_an_attention_class_table_is_refused_when_it_asks_for_ring_flash():
    # GPT-Neo picks its attention class from GPT_NEO_ATTENTION_CLASSES by implementation name
    # while building its layers (KeyError: 'ring_flash'), before post_init: `import hf_ring`
    # runs the check at the end of PreTrainedModel.__init__ (patches/transformers/hooks.py).
    # So did Falcon up to transformers 5.24.
    cases = [("gpt_neo", "GPT_NEO_ATTENTION_CLASSES", "GPTNeoForCausalLM", {"attention_types": [[["global"], 2]], "num_layers": 2})]
    if not FALCON_ON_INTERFACE:
        cases.append(("falcon", "FALCON_ATTENTION_CLASSES", "FalconForCausalLM", {}))
    for model_type, table, model_class, overrides in cases:
        with pytest.raises(NotImplementedError, match=table) as error:
            tiny(model_type, attn_implementation="ring_flash", **overrides)
        assert model_class in str(error.value) and "'sdpa'" in str(error.value), error.value
        # Other implementations are left alone by the same hook.
        assert tiny(model_type, attn_implementation="eager", **overrides).config._attn_implementation == "eager"


@pytest.mark.skipif(not FALCON_ON_INTERFACE, reason="Falcon goes through the attention interface from transformers 5.25")
def test_falcon_on_the_attention_interface_is_created_and_refused_under_cp_by_name():
    # transformers 5.25's Falcon goes through the attention interface, so it is created with
    # ring_flash (exact without CP: tests/test_model_sweep.py), but its FalconModel and
    # FalconDecoderLayer take **kwargs and drop them: the guard's context never reaches the
    # ring (issue 51: it failed inside the first attention layer with a message about an
    # unguarded model). Refused before the forward, naming both.
    falcon = tiny("falcon", attn_implementation="ring_flash")
    found = refusal(falcon)
    assert "keyword arguments stop at FalconModel.forward, FalconDecoderLayer.forward" in found, found
    assert "under context parallelism (cp_size=2)" in found, found
    assert "on packed rows" in refusal(falcon, cp_size=1, doc_lens=[32, 32])
    assert refusal(falcon, cp_size=1) == ""
    # ALiBi Falcon adds its position bias to the mask, which the ring never reads: refused
    # for that first, under CP and on packed rows; without either it is SDPA with that mask.
    alibi = tiny("falcon", attn_implementation="ring_flash", alibi=True)
    for found in (refusal(alibi), refusal(alibi, cp_size=1, doc_lens=[32, 32])):
        assert "FalconConfig has alibi=True" in found and "ALiBi" in found, found
    assert refusal(alibi, cp_size=1) == ""


class _DroppingLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    # Takes the layer's keyword arguments and drops them, as Falcon's layers do on 5.25.
    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs):
        return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                               position_embeddings=position_embeddings)


@pytest.mark.skipif(Version(transformers.__version__) < Version("5"),
                    reason="the dropped-keywords reading runs on transformers 5 only (hf_ring/hf/support/interface.py)")
def test_layers_that_drop_the_forward_s_keywords_are_refused_under_cp():
    model = tiny("llama", attn_implementation="ring_flash")
    assert refusal(model) == ""
    model = tiny("llama", attn_implementation="ring_flash")
    model.model.layers[1].__class__ = _DroppingLayer
    found = refusal(model)
    assert "keyword arguments stop at _DroppingLayer.forward:" in found, found
    assert "LlamaModel" not in found, found
    assert refusal(model, cp_size=1) == ""


def test_attention_outside_the_interface_is_refused_and_interface_models_are_not():
    # Bloom's attention runs its own code (no ALL_ATTENTION_FUNCTIONS): ring_flash would
    # never be called. The config is switched after creation, as a patched
    # set_attn_implementation would leave it, so that only this check is exercised.
    bloom = tiny("bloom", attn_implementation="eager")
    bloom.config._attn_implementation = "ring_flash"
    with pytest.raises(NotImplementedError, match=re.escape("h.0.self_attention (BloomAttention)")):
        check_model_supported(bloom)
    for model_type in ("llama", "qwen2", "gpt2", "lfm2"):
        model = tiny(model_type, attn_implementation="eager")
        model.config._attn_implementation = "ring_flash"
        check_model_supported(model)  # no error: their attention goes through the interface
    # A model that does not ask for ring_flash is not checked at all.
    check_model_supported(tiny("bloom", attn_implementation="eager"))


# --- plain transformers are not refused -----------------------------------------------


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {}),  # default window 4096 >= the sequence: masks nothing
        ("gemma", dict(head_dim=8)),
        ("gemma2", dict(head_dim=8)),  # sliding layers with a 4096 window
        ("mixtral", dict(num_local_experts=2)),
        ("qwen2_moe", dict(num_experts=2)),  # use_sliding_window=False (its window is then 0)
        ("gpt2", {}),  # transformers' Conv1D is a per-token linear layer
        ("seed_oss", {}),  # "SeedOssModel" must not read as an SSM
        ("llama4_text", dict(head_dim=8, num_local_experts=2, intermediate_size_mlp=64)),  # chunk 8192, floor 8192
    ],
)
def test_plain_transformers_are_not_refused(model_type, overrides):
    model = tiny(model_type, **overrides)
    assert refusal(model) == "", (model_type, refusal(model))
    assert refusal(model, cp_size=1, doc_lens=[32, 32]) == ""


# --- cost: the model is read once -----------------------------------------------------


def test_the_model_is_read_once_per_config(monkeypatch):
    model = tiny("llama")
    reads = []
    read = detectors.read_model
    monkeypatch.setattr(detectors, "read_model", lambda m: reads.append(1) or read(m))
    check_model_under_cp(model, CP, 0 + SEQ)  # no refusal, but the model was read
    check_model_under_cp(model, CP, SEQ * 2)
    check_model_under_cp(model.model, CP, SEQ)  # the base model, as the guard passes it: its own cache
    assert len(reads) == 2, reads
    # Without CP and without packed rows the ring does not run: nothing is read.
    check_model_under_cp(tiny("qwen2"), 1, SEQ)
    assert len(reads) == 2, reads
    # A replaced config is read again.
    model.config = AutoConfig.for_model("llama", **_TINY, **rope(rope_type="dynamic", factor=2.0))
    assert "dynamic" in refusal(model, seq_len=256)
    assert len(reads) == 3, reads
