"""Tiny random configs for every causal-LM family of the installed transformers.

Why: hf_ring's contract is that a model under context parallelism computes the same
function as without it, or is refused. The families a user may load are whatever
``AutoModelForCausalLM`` knows, so the sweep (``tests/model_sweep.py``) builds each of
them small enough to run in a fraction of a second on a CPU, with nothing downloaded.

``build_config(name)`` starts from the family's own defaults (``AutoConfig.for_model``)
and applies, in order:

1. ``COMMON``: hidden 64, 2 layers, 4 query heads over 2 KV heads of 16, vocabulary 128,
   256 positions, float32, no cache;
2. ``SHRINK``, where the family's config has the attribute: small MoE (4 experts, 2 per
   token), low-rank attention, SSM state, indexers; a sliding window or attention chunk
   of 8 tokens where the defaults use one (shorter than the sweep's 32 tokens, as a
   long-context run's sequences are longer than the window); multi-head latent attention
   gets one KV head per query head;
3. hybrids get one layer of every layer type their full-size default uses;
4. ``OVERRIDES[model_type]``: what a family needs on top (``DROP``: let the config derive it).

Dropout probabilities and router noise keep the family's defaults: the sweep compares
training forwards from the same seed, in which every random draw must be made as one
process makes it, or refused (issue 36; the sweep zeroed them before, and so hid it).

Keys a config derives itself (read-only properties) are never passed. ``VARIANTS`` add
configs that exercise what the defaults do not (sequence-length-dependent RoPE, windows
a family leaves off by default, Llama 4 temperature tuning alone). ``NOT_SWEPT`` lists the
model types left out, with the reason: decoders of encoder-decoder models, multimodal
models (their text decoders are swept), models that do not run on their own.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

WRITTEN_FOR = "5.25.0"  # the transformers release these tables were written against
SEQ = 32  # tokens per row in the sweep; windows and chunks below are shorter
WINDOW = 8

COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    use_cache=False,
    dtype="float32",
)

# Applied only where the family's default config has the attribute.
SHRINK: dict[str, Any] = dict(
    # mixtures of experts: 4 small experts, 2 per token
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    shared_intermediate_size=32,
    expert_ffn_hidden_size=32,
    dense_intermediate_size=128,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    moe_k=2,
    moe_topk=2,
    num_shared_experts=1,
    n_shared_experts=1,
    moe_num_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_expert_group=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,
    # multi-head latent attention (DeepSeek-style)
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,  # another size than Q/K's 16, as in the released models (192 / 128)
    # sparse-attention indexers
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,
    # linear attention / SSM / convolutions
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=16,
    mamba_chunk_size=16,
    mamba_d_ssm=128,
    ssm_state_size=16,
    mamba_num_heads=4,
    mamba_head_dim=32,
    chunk_size=16,
    n_groups=1,
    # vocabularies and head counts some families keep apart
    unpadded_vocab_size=128,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    # windows and chunks shorter than the sequence
    sliding_window=WINDOW,
    sliding_window_size=WINDOW,
    attention_window_size=WINDOW,
    attention_chunk_size=WINDOW,
    max_window_layers=1,
    sliding_window_pattern=2,
    global_attn_every_n_layers=2,
    # per-layer input embeddings (Gemma 3n / 4)
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=16,
)

_ONLY_IF_ACTIVE = ("sliding_window", "sliding_window_size", "attention_window_size", "attention_chunk_size")

class _Drop:
    """An OVERRIDES value: do not pass this key (the config derives it). Survives deepcopy."""

    def __deepcopy__(self, memo: dict) -> "_Drop":
        return self

    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()

# Encoder architectures that transformers also offers as causal LMs (BertLMHeadModel...):
# built as decoders (causal self-attention), which is what their causal-LM class is for.
_AS_DECODER = dict(is_decoder=True)

OVERRIDES: dict[str, dict[str, Any]] = {
    **{
        t: _AS_DECODER
        for t in (
            "bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
            "rembert", "roberta", "roberta-prelayernorm", "roformer", "xlm-roberta", "xlm-roberta-xl",
        )
    },
    "bamba": dict(attn_layer_indices=[1]),
    "big_bird": dict(is_decoder=True, attention_type="original_full"),
    "codegen": dict(rotary_dim=8),
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0), "full_attention": None},
    ),
    "cpmant": dict(dim_ff=128, dim_head=16),
    "dots3_note_text": dict(
        num_key_value_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32,
        swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16,
    ),
    # transformers 5.25's new families: one dense layer of first_dense_intermediate_size, a
    # full-attention layer every global_attention_every_n_layers; an indexer's head count and
    # pools within the tiny sizes (its validator checks them against the query heads).
    "ergo": dict(first_dense_intermediate_size=128, global_attention_every_n_layers=2),
    "falcon": dict(head_dim=DROP),
    "kolibri1_1": dict(index_num_heads=2, index_topk=8, index_pool_size=16, index_compression=4,
                       index_num_local_tokens=4, index_num_sink_tokens=2, mlp_only_intermediate_size=128),
    "gemma3n_text": dict(
        num_kv_shared_layers=0, laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0, 0.0],
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "gptj": dict(rotary_dim=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=8
    ),
    # LFM2's default config has attention layers only; its checkpoints mix in short convolutions
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # layer 0 chunked attention with RoPE, layer 1 NoPE with attention temperature tuning;
    # floor_scale 8 (8192 in checkpoints) so that the tuning varies within 32 tokens
    "llama4_text": dict(no_rope_layers=[1, 0], floor_scale=8),
    "mamba2": dict(num_heads=4, head_dim=32, state_size=16, chunk_size=16),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
        hc_lowrank=16, ngram_vocab_size_base=256,
    ),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64),
    "reformer": dict(
        is_decoder=True, attn_layers=["local", "local"], axial_pos_embds=False, local_attn_chunk_length=WINDOW,
        feed_forward_size=128, attention_head_size=16,
    ),
    "roc_bert": dict(is_decoder=True, shape_vocab_size=64, pronunciation_vocab_size=64, shape_embed_dim=16,
                     pronunciation_embed_dim=16),
    "xlnet": dict(max_position_embeddings=DROP, d_inner=128, d_head=16),
    "xmod": dict(is_decoder=True, default_language="en_XX"),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
}

# name -> (model_type, overrides): configs that exercise what the defaults do not.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Phi-3/3.5 128K style: long factors above original_max_position_embeddings. With
    # zigzag at cp=2 over 32 tokens, rank 0 holds positions up to 31 (long factors),
    # rank 1 up to 23; 24 makes the ranks disagree as a 128K checkpoint does at 5K.
    "phi3_longrope": (
        "phi3",
        dict(
            original_max_position_embeddings=24,  # Phi3Config's own field wins over rope_parameters'
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                original_max_position_embeddings=24,
                short_factor=[1.0] * 8,
                long_factor=[1.0 + 0.5 * i for i in range(8)],
            ),
        ),
    ),
    # Qwen2-MoE with its sliding window on (layer 1 slides, layer 0 does not): the layers
    # do not pass the window to the attention function, the mask alone applies it.
    "qwen2_moe_sliding": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # PhiMoE with a sliding window: applied through the mask only, as in Qwen2-MoE
    "phimoe_sliding": ("phimoe", dict(sliding_window=WINDOW)),
    # Llama 4 temperature tuning alone (no chunk shorter than the sequence)
    "llama4_text_temperature": (
        "llama4_text",
        dict(attention_chunk_size=8192, layer_types=["full_attention", "full_attention"]),
    ),
    # dynamic NTK scaling: frequencies are recomputed when the largest position seen passes
    # max_position_embeddings (24 here, so that rank 0's shard passes it and rank 1's does not)
    "llama_dynamic_rope": (
        "llama",
        dict(max_position_embeddings=24, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)),
    ),
    # Hidden, residual and embedding dropout, and router noise, where the defaults' attention
    # dropout (refused under CP) would hide them: every family that draws, drawn under CP.
    "gpt2_dropout": ("gpt2", dict(attn_pdrop=0.0)),
    "bert_dropout": ("bert", dict(attention_probs_dropout_prob=0.0)),
    "seed_oss_dropout": ("seed_oss", dict(attention_dropout=0.0)),
    "phi_dropout": ("phi", dict(resid_pdrop=0.1, embd_pdrop=0.1)),
    "mixtral_jitter": ("mixtral", dict(router_jitter_noise=0.1)),
    "phimoe_noisy": ("phimoe", dict(router_jitter_noise=0.3, input_jitter_noise=0.1)),
}

_ENC_DEC = "the decoder of an encoder-decoder model (cross-attention), not a decoder-only LM"
_MULTIMODAL = (
    "a multimodal model (the image-text ones are in the multimodal sweep, tests/vlm_sweep.py; "
    "a text decoder is swept here on its own where it has one)"
)
NOT_SWEPT: dict[str, str] = {
    **{
        t: _ENC_DEC
        for t in (
            "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
            "pegasus", "plbart", "prophetnet", "trocr", "whisper",
        )
    },
    **{
        t: _MULTIMODAL
        for t in (
            "emu3", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "git", "got_ocr2",
            "llama4", "mllama", "moshi", "moss_transcribe_diarize", "phi4_multimodal", "qwen3_5",
            "qwen3_5_moe", "qwen4_exp", "musicgen", "musicgen_melody", "dots3_note",
        )
    },
    "gemma4_assistant": "a speculative-decoding assistant: it reads the target model's KV cache "
    "(num_kv_shared_layers must equal its layer count), so it does not run on its own",
    "gemma4_unified_assistant": "a speculative-decoding assistant: it reads the target model's KV cache, "
    "so it does not run on its own",
    "blt": "a byte-level model of four sub-models (a patcher, a local encoder and decoder, a global "
    "transformer over entropy-based patches, cross-attention between them), not a token-sequence decoder; "
    "not built tiny here",
    "dbrx": "transformers 5.24 cannot build DbrxForCausalLM from its own config class "
    "(AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta', defaults included)",
}


def family_names() -> list[str]:
    """Every causal-LM model type of the installed transformers, then the variants."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + sorted(VARIANTS)


def model_type_of(name: str) -> str:
    return VARIANTS[name][0] if name in VARIANTS else name


_MISSING = object()


def _get(config: PretrainedConfig, key: str) -> Any:
    """The attribute, or _MISSING; some configs raise other errors than AttributeError
    for attributes that vary per layer."""
    try:
        return getattr(config, key)
    except Exception:  # noqa: BLE001
        return _MISSING


def _read_only(config_class: type, key: str) -> bool:
    key = getattr(config_class, "attribute_map", {}).get(key, key)
    attribute = inspect.getattr_static(config_class, key, None)
    return isinstance(attribute, property) and attribute.fset is None


def _one_layer_of_each(defaults: PretrainedConfig, key: str) -> list[str] | None:
    """One layer of every type the full-size default uses, or None if it has one type."""
    types = _get(defaults, key)
    if not isinstance(types, (list, tuple)) or len(set(types)) < 2:
        return None
    return list(dict.fromkeys(types))  # first-use order


def build_config(name: str) -> PretrainedConfig:
    """The tiny config of sweep family ``name`` (a model type or a variant)."""
    model_type = model_type_of(name)
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    kwargs: dict[str, Any] = dict(COMMON)
    kwargs.update({k: v for k, v in SHRINK.items() if _get(defaults, k) is not _MISSING and k not in _ONLY_IF_ACTIVE})
    # A window or chunk is shrunk only where the family uses one by default.
    kwargs.update({k: SHRINK[k] for k in _ONLY_IF_ACTIVE if _get(defaults, k) not in (_MISSING, None, 0)})
    if _get(defaults, "kv_lora_rank") is not _MISSING:
        # multi-head latent attention: one KV head per query head; RoPE on qk_rope_head_dim
        kwargs.update(num_key_value_heads=COMMON["num_attention_heads"], head_dim=SHRINK["qk_rope_head_dim"])
    per_layer = {}
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        types = _one_layer_of_each(defaults, key)
        if types is not None:
            per_layer[key] = types
    if per_layer:
        layers = max(2, *(len(types) for types in per_layer.values()))
        kwargs["num_hidden_layers"] = layers
        for key, types in per_layer.items():
            kwargs[key] = [types[i % len(types)] for i in range(layers)]
    kwargs.update(copy.deepcopy(OVERRIDES.get(model_type, {})))
    if name in VARIANTS:
        kwargs.update(copy.deepcopy(VARIANTS[name][1]))
    # DROP, and what the config derives itself (read-only properties), is not passed
    kwargs = {k: v for k, v in kwargs.items() if v is not DROP and not _read_only(config_class, k)}
    return AutoConfig.for_model(model_type, **kwargs)
