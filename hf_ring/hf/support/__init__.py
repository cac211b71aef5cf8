"""Which models ``ring_flash`` can run exactly, read from the model itself.

Why: the ring computes attention across ranks, and only attention. Everything else a
model does along the sequence runs on the tokens a rank holds: under context parallelism
(CP) its shard, in packed rows the whole row across document boundaries. The guard
checks that every attention layer ran the ring, but a model can be wrong without any
attention layer being skipped (issue 10): a short convolution or a Mamba mixer sees only
the local shard, a RoPE whose frequencies depend on the sequence length picks them from
the shard's largest position, a sliding window that the model applies through its mask
only never reaches the attention function, Llama 4's temperature tuning numbers the
local tokens from 0. Each of these trains a different function from the model without
CP, and says nothing. So the model is read (its modules and its config, once per model
and config) and refused, naming the module or the config field and what to do, where it
cannot be run exactly.

Two entry points:

- :func:`check_model_under_cp`: whenever the ring runs (``cp_size > 1``, or packed rows
  without CP), once per guarded forward, after the inputs were validated (so every rank
  passes the same lengths and raises the same error). The model's structure is read on
  the first call and cached in the model's ``__dict__``; later calls only compare the
  forward's lengths with the cached bounds.
- :func:`check_model_supported`: when a model asks for ``ring_flash`` (model creation,
  ``set_attn_implementation``): refuses models whose attention does not go through
  transformers' attention interface, which would never call ``ring_flash``.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch.nn as nn

from hf_ring.patches.transformers import attn_implementation

RING_FLASH = "ring_flash"
# Cached in the module's own __dict__, like the guard's flags: copies of the model carry it.
_CACHE = "_hf_ring_model_support"

# Layer kinds (config.layer_types and the older per-family lists) that mix tokens only
# through attention the ring computes, or not at all (MLP / MoE layers are per token).
_RING_LAYER_KINDS = frozenset({"full_attention", "attention", "sliding_attention", "chunked_attention"})
_PER_TOKEN_LAYER_KINDS = frozenset({"moe", "mlp", "dense", "sparse"})
_TOKEN_MIXING_LAYER_KINDS = frozenset(
    {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent", "rwkv", "ssm"}
)
# Per-family lists of layer kinds besides transformers' `layer_types` (Jamba and
# Nemotron-H in 4.57, RecurrentGemma), and Nemotron-H's pattern string, one character a
# layer, read through its legend.
_LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern")
_PATTERN_LEGEND = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}

# Names of sequence mixers that are not attention: a further signal next to the
# structural ones below (a convolution over time, SSM parameters). Matched on the class
# name without the family's prefix (every class of MambaModel is "Mamba...", its norms
# too), case-sensitive so that "GptOssModel" is no SSM; and on the start of the attribute
# a module is held under (xLSTM's `mlstm_layer`, not its `norm_mlstm`). "Conv" alone is
# not among them: transformers' GPT-2 style `Conv1D` is a per-token linear layer.
_MIXER_CLASS = re.compile(
    r"Mamba|SSM|Ssm(?![a-z])|SelectiveScan|LinearAttention|LinearAttn|Lightning|DeltaNet|GatedDelta"
    r"|DeltaAttention|Rwkv|RWKV|Retention|LSTM|Lstm|Hyena|ShortConv|CausalConv|Rglru|RGLRU"
    r"|RecurrentBlock|TimeMix|TokenShift|Griffin"
)
_MIXER_ATTRIBUTE = re.compile(
    r"mamba|ssm|mlstm|slstm|linear_attn|linear_attention|rwkv|short_conv|shortconv|time_mix|rg_lru"
    r"|deltanet|retention"
)
_FAMILY_SUFFIX = re.compile(r"(Text)?(Model|ForCausalLM|LMHeadModel)$")
# Sub-trees of another modality inside a language model's base model (Phi-4-multimodal's
# image and audio encoders): their patch and frame convolutions run before the tokens exist.
_TOWER = re.compile(r"(^|_)(vision|visual|image|img|audio|speech|video)")
# Parameters of state-space / linear-recurrence mixers: Mamba's A_log and dt_bias, RWKV's
# time decay and time-mix coefficients.
_SSM_PARAMETERS = frozenset({"A_log", "dt_bias", "time_decay", "time_first", "time_faaaa"})
_SSM_PARAMETER_PREFIXES = ("time_mix_", "time_maa")
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class _Bound:
    """The model is exact while ``length < bound``, where length is the forward's longest
    attention span (``span``: the sequence, or the longest packed document; ``packed``:
    the longest packed document, dense rows unbounded) or its whole row (``row``)."""

    bound: int
    measure: str
    message: str  # formatted with {length}, {where}, {limit} (= bound - 1)


@dataclass(frozen=True)
class _Support:
    config_id: int
    refusals: tuple[str, ...]  # formatted with {where}
    bounds: tuple[_Bound, ...]


def check_model_under_cp(
    model: nn.Module, cp_size: int, seq_len: int, doc_lens: Optional[Sequence[int]] = None
) -> None:
    """Refuse a model that the ring cannot run exactly on this forward's lengths.

    Call it whenever the ring runs: under context parallelism (``cp_size > 1``) and for
    packed rows without it (``cp_size == 1`` with ``doc_lens``), after the forward's
    inputs were validated across the CP group, so that every rank raises the same error.
    The model is read on the first call (cached in its ``__dict__``, re-read when its
    ``config`` object is replaced; a config edited in place is not re-read).

    Args:
        model: the model or its base model (``LlamaForCausalLM`` or ``LlamaModel``).
        cp_size: the context-parallel group's size (1: packed rows without CP).
        seq_len: the forward's full (global) row length in tokens, padding included:
            ``local_seq * cp_size``.
        doc_lens: a packed row's global document lengths, or None for dense rows.

    Raises:
        NotImplementedError: naming the module or config field and what to do.
    """
    if cp_size <= 1 and doc_lens is None:
        return  # the ring does not run: ring_flash is transformers' SDPA
    support = model.__dict__.get(_CACHE)
    config = getattr(model, "config", None)
    if support is None or support.config_id != id(config):
        support = _read_model(model)
        model.__dict__[_CACHE] = support
    where = f"under context parallelism (cp_size={cp_size})" if cp_size > 1 else "on packed rows"
    if support.refusals:
        raise NotImplementedError(support.refusals[0].format(where=where))
    span = max(doc_lens) if doc_lens else seq_len
    for b in support.bounds:
        if b.measure == "packed" and not doc_lens:
            continue
        length = seq_len if b.measure == "row" else span
        if length >= b.bound:
            raise NotImplementedError(b.message.format(length=length, where=where, limit=b.bound - 1))


def check_model_supported(model: nn.Module) -> None:
    """Refuse a model that asks for ``ring_flash`` but whose attention does not go
    through transformers' attention interface, so would never call it.

    Two ways a model's attention can bypass the interface: its modeling module picks the
    attention class from a table keyed by implementation name (Falcon's
    ``FALCON_ATTENTION_CLASSES``, GPT-Neo's), which has no ``ring_flash`` entry and fails
    with ``KeyError: 'ring_flash'`` while the model builds its layers; or its attention
    classes come from a module that does not use ``ALL_ATTENTION_FUNCTIONS`` (Bloom,
    MPT, ...), which would run their own eager or SDPA code instead. The first is
    checked from the model's class alone, so this can run at the end of
    ``PreTrainedModel.__init__``, before the layers are built; the second needs the
    built modules (after ``post_init``). A model that does not ask for ``ring_flash`` is
    left alone.

    Raises:
        NotImplementedError: naming the class and what to do.
    """
    config = getattr(model, "config", None)
    if config is None or attn_implementation(config) != RING_FLASH:
        return
    variants = _uncomputed_attention_kinds(config)
    if variants:
        raise NotImplementedError(
            f"{type(model).__name__}'s config has attention layers of kinds {variants} (sparse, indexed "
            f"or compressed attention), which {RING_FLASH!r} does not compute with or without context "
            "parallelism (it computes dense causal attention); use the attention implementation the "
            "model documents (e.g. 'eager') without context parallelism"
        )
    module = sys.modules.get(type(model).__module__)
    tables = vars(module).items() if module is not None else ()
    for name, table in tables:
        if _is_attention_class_table(table) and RING_FLASH not in table:
            raise NotImplementedError(
                f"{type(model).__name__} picks its attention class from {module.__name__}.{name} by "
                f"attention implementation (it has {sorted(table)}), not through transformers' attention "
                f"interface, so it cannot run attn_implementation={RING_FLASH!r} (with or without context "
                "parallelism); use attn_implementation='sdpa' or 'eager' without context parallelism"
            )
    bypassing = [
        f"{path} ({type(m).__name__})"
        for path, m in _text_stack(model).named_modules()
        if type(m).__name__.endswith("Attention")
        and not type(m).__module__.startswith("torch.")
        and not any(_TOWER.search(part) for part in path.split("."))
        and not _uses_attention_interface(type(m))
    ]
    if bypassing:
        raise NotImplementedError(
            f"{type(model).__name__}'s attention modules {_listed(bypassing)} do not go through "
            f"transformers' attention interface, so they would never call {RING_FLASH!r} (they run "
            "their own attention code); this model is not supported by hf_ring: use "
            "attn_implementation='sdpa' or 'eager' without context parallelism"
        )


def _is_attention_class_table(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and "eager" in value
        and all(isinstance(v, type) and issubclass(v, nn.Module) for v in value.values())
    )


def _uses_attention_interface(cls: type) -> bool:
    # Modeling modules that dispatch attention by implementation name import transformers'
    # registry under this name (4.57 and 5.x alike).
    module = sys.modules.get(cls.__module__)
    return module is not None and "ALL_ATTENTION_FUNCTIONS" in vars(module)


def _text_stack(model: nn.Module) -> nn.Module:
    """The modules that run along the language model's token sequence: the base model, or
    its ``language_model`` in a multimodal model (a vision tower's patch convolutions do
    not run along the token sequence)."""
    base = getattr(model, "base_model", model)
    language_model = getattr(base, "language_model", None)
    return language_model if isinstance(language_model, nn.Module) else base


def _listed(items: Sequence[str], most: int = 4) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _layer_configs(config: Any, names: Sequence[str]) -> list[dict[str, Any]]:
    """``names`` read from the config: one dict, or one per layer where transformers 5's
    heterogeneous configs refuse to read a per-layer attribute globally (Gemma 4's
    ``head_dim``: an ``AmbiguousGlobalPerLayerAttributeError``, a RuntimeError)."""
    try:
        return [{name: getattr(config, name, None) for name in names}]
    except RuntimeError:
        layers = getattr(config, "per_layer_config", None) or []
        return [{name: getattr(layer, name, None) for name in names} for layer in layers]


def _config_values(config: Any, name: str) -> list[Any]:
    """Every value ``name`` takes in the config (one, or one per layer, see above)."""
    return [layer[name] for layer in _layer_configs(config, (name,))]


def _smallest(config: Any, name: str) -> Optional[int]:
    """The smallest positive int ``name`` takes in the config, or None."""
    ints = [v for v in _config_values(config, name) if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(ints, default=None)


def _first(config: Any, name: str) -> Any:
    return next((v for v in _config_values(config, name) if v is not None), None)


def _read_model(model: nn.Module) -> _Support:
    config = getattr(model, "config", None)
    modules = list(_text_stack(model).named_modules())
    refusals = [*_token_mixers(modules), *_layer_kinds(config), *_value_head_size(config, modules)]
    bounds = [*_rope_bounds(config, modules), *_window_bounds(config, modules), *_temperature_bounds(config)]
    return _Support(id(config), tuple(refusals), tuple(bounds))


# --- token mixers other than attention ---------------------------------------------


def _token_mixer_reason(path: str, module: nn.Module, family: str) -> Optional[str]:
    if isinstance(module, _CONVOLUTIONS):
        kernel, stride = tuple(module.kernel_size), tuple(module.stride)
        if all(k == 1 for k in kernel):
            return None  # a pointwise convolution is per token
        if isinstance(module, (nn.Conv2d, nn.Conv3d)) and kernel == stride and not any(module.padding):
            return None  # an image / video patch embedding: disjoint patches, not along the tokens
        return f"a convolution over the sequence (kernel {kernel[0] if len(kernel) == 1 else kernel})"
    own = {name for name, _ in module.named_parameters(recurse=False)}
    ssm = sorted(n for n in own if n in _SSM_PARAMETERS or n.startswith(_SSM_PARAMETER_PREFIXES))
    if ssm:
        return f"a state-space / recurrent mixer (parameters {', '.join(ssm)})"
    name = type(module).__name__
    if _MIXER_CLASS.search(name[len(family):] if family and name.startswith(family) else name) or (
        _MIXER_ATTRIBUTE.match(path.rsplit(".", 1)[-1].lower())
    ):
        return "a sequence mixer that is not attention (Mamba / SSM / linear attention / RWKV / xLSTM style)"
    return None


def _token_mixers(modules: list[tuple[str, nn.Module]]) -> Iterator[str]:
    family = _FAMILY_SUFFIX.sub("", type(modules[0][1]).__name__) if modules else ""
    reasons = {
        path: reason
        for path, m in modules
        if not any(_TOWER.search(part) for part in path.split("."))
        and (reason := _token_mixer_reason(path, m, family)) is not None
    }
    # One entry per mixer, the innermost that says why: a Jamba Mamba layer's mixer, not
    # the layer around it; a convolution inside a reported mixer is part of it.
    named = [p for p in reasons if not reasons[p].startswith("a convolution")]
    named = [p for p in named if not any(q.startswith(p + ".") or (p == "" and q) for q in named if q != p)]
    convs = [p for p in reasons if reasons[p].startswith("a convolution")]
    convs = [p for p in convs if not any(p.startswith(q + ".") or q == "" for q in named)]
    classes = dict(modules)
    kept = [p for p in reasons if p in named or p in convs]
    found = [f"{p or '<model>'} ({type(classes[p]).__name__}: {reasons[p]})" for p in kept]
    if found:
        yield (
            f"{_listed(found)} mix tokens along the sequence without attention; hf_ring computes only "
            "attention across the sequence, so {where} these would see only the tokens this rank "
            "holds (in packed rows: across document boundaries) and the model would train a "
            "different function without a word. Train this model without context parallelism and "
            "without packed rows, or use a model whose only token-mixing layers are attention"
        )


def _uncomputed_attention_kinds(config: Any) -> list[str]:
    """Layer kinds named as attention that are neither the ring's (full, sliding, chunked)
    nor token mixers refused only under CP (linear attention runs whole without CP)."""
    found: set[str] = set()
    for field in _LAYER_KIND_FIELDS:
        kinds = _first(config, field)
        if isinstance(kinds, (list, tuple)):
            found |= {
                str(k) for k in kinds
                if "attention" in str(k).lower() and str(k) not in _RING_LAYER_KINDS
                and str(k).lower() not in _TOKEN_MIXING_LAYER_KINDS
            }
    return sorted(found)


def _layer_kinds(config: Any) -> Iterator[str]:
    for field in _LAYER_KIND_FIELDS:
        kinds = _first(config, field)
        if isinstance(kinds, str):
            kinds = [_PATTERN_LEGEND.get(c, c) for c in kinds]
        if not isinstance(kinds, (list, tuple)):
            continue
        others = sorted({str(k) for k in kinds} - _RING_LAYER_KINDS - _PER_TOKEN_LAYER_KINDS)
        if not others:
            continue
        layers = [i for i, k in enumerate(kinds) if str(k) in others]
        mixing = [k for k in others if k.lower() in _TOKEN_MIXING_LAYER_KINDS]
        what = (
            "layers that mix tokens without attention (convolutions, SSM / Mamba, linear attention)"
            if mixing
            else "attention variants the ring does not compute (sparse / indexed / compressed / "
            "non-overlapping windows), or kinds hf_ring does not know"
        )
        yield (
            f"config.{field} has {others} layers (layers {_listed([str(i) for i in layers], 8)}): {what}; "
            "{where} ring_flash would compute them wrongly without a word. Train this model without "
            "context parallelism and without packed rows"
        )
        return


# --- attention shapes the ring does not carry ----------------------------------------


def _value_head_size(config: Any, modules: list[tuple[str, nn.Module]]) -> Iterator[str]:
    pairs = []
    names = ("v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "head_dim")
    for layer in _layer_configs(config, names):
        v, nope, rope = layer.get("v_head_dim"), layer.get("qk_nope_head_dim"), layer.get("qk_rope_head_dim")
        qk = nope + rope if nope is not None and rope is not None else layer.get("qk_head_dim")
        qk = qk if qk is not None else layer.get("head_dim")
        pairs.append((v, qk, "config.v_head_dim", "the Q/K head size (qk_nope_head_dim + qk_rope_head_dim)"))
    # The attention modules' own sizes, for configs that name them otherwise.
    for path, m in modules:
        mv, mqk = getattr(m, "v_head_dim", None), getattr(m, "qk_head_dim", None)
        if isinstance(mv, int) and isinstance(mqk, int):
            pairs.append((mv, mqk, f"{path}.v_head_dim", "its qk_head_dim"))
    for v, qk, v_name, qk_name in pairs:
        if isinstance(v, int) and isinstance(qk, int) and v != qk:
            yield (
                f"multi-head latent attention (DeepSeek-V2/V3 style): {v_name}={v} differs from "
                f"{qk_name}={qk}; the ring takes K and V of one head size, so {{where}} ring_flash cannot "
                "run this model. Train it without context parallelism and without packed rows"
            )
            return


# --- what depends on the sequence length ---------------------------------------------


def _rope_dicts(config: Any) -> Iterator[tuple[str, dict]]:
    """Every RoPE parameter dict of the config: transformers 5's ``rope_parameters`` (one
    dict, or one per layer type) and 4.57's ``rope_scaling``, with where each was found."""
    for field in ("rope_parameters", "rope_scaling"):
        for value in _config_values(config, field):
            if not isinstance(value, dict):
                continue
            if any(isinstance(v, dict) for v in value.values()):
                for layer_type, sub in value.items():
                    if isinstance(sub, dict):
                        yield f"config.{field}[{layer_type!r}]", sub
            else:
                yield f"config.{field}", value


def _rope_bounds(config: Any, modules: list[tuple[str, nn.Module]]) -> Iterator[_Bound]:
    max_positions = _smallest(config, "max_position_embeddings")
    # The rotary modules' own threshold for recomputing frequencies (transformers sets it
    # from max_position_embeddings; read in case a family sets it otherwise).
    thresholds = [getattr(m, "original_max_seq_len", None) for _, m in modules]
    for where_found, rope in _rope_dicts(config):
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        original = rope.get("original_max_position_embeddings")
        original = original or _smallest(config, "original_max_position_embeddings")
        if "dynamic" in rope_type:
            # Recomputed from max(position_ids) + 1 once it reaches max_position_embeddings
            # (and reset below it): a rank sees its own shard's largest position. Below
            # the threshold no rank and no full-sequence run recomputes, or all reset.
            limit = min([x for x in (max_positions, original, *thresholds) if isinstance(x, int)], default=0)
            yield _Bound(limit, "span", _rope_message(rope_type, where_found, "max_position_embeddings"))
        elif rope_type == "longrope":
            # Long factors once max(position_ids) + 1 exceeds original_max_position_embeddings:
            # the rank holding the last token switches, the others may not.
            limit = original + 1 if isinstance(original, int) else 0
            yield _Bound(limit, "span", _rope_message(rope_type, where_found, "original_max_position_embeddings"))


def _rope_message(rope_type: str, where_found: str, threshold: str) -> str:
    return (
        f"{where_found} has rope_type={rope_type!r}, whose frequencies depend on the largest position "
        "in the forward: {where} each rank would pick them from the positions it holds, not from the "
        "full sequence's, and the ranks would disagree. It is exact only for sequences (documents) "
        f"of at most {{limit}} tokens (below {threshold}); this forward has {{length}}. Use shorter "
        "sequences, a RoPE type that does not depend on the length (default, linear, yarn, llama3), "
        "or train without context parallelism and without packed rows"
    )


def _window_bounds(config: Any, modules: list[tuple[str, nn.Module]]) -> Iterator[_Bound]:
    """Sliding windows and attention chunks as the config sets them, whatever the model
    passes to the attention function: Qwen2-MoE, PhiMoE and Llama 4 apply theirs through
    the mask only, which ring_flash under CP (and on packed rows) does not take.

    The ring computes a sliding window on dense rows when the attention layers pass it as
    ``sliding_window=`` to the attention function (Mistral, Mixtral, Gemma 2/3, Qwen2,
    GPT-OSS, Cohere 2, ...): such models are bounded on packed rows only."""
    window = _smallest(config, "sliding_window")
    # Qwen2 / Qwen3-MoE clear the window when use_sliding_window is False, Qwen2-MoE sets it to 0.
    if window is not None and not all(v is False for v in _config_values(config, "use_sliding_window")):
        # Key j is visible to query i when 0 <= i - j < window: a window of at least the
        # span masks nothing.
        measure = "packed" if _passes_window(modules) else "span"
        yield from _masked_layers(config, "sliding_window", window, "sliding_attention", "a sliding window",
                                  measure)
    chunk = _smallest(config, "attention_chunk_size")
    if chunk is not None:
        # Query i sees key j only in the same chunk (i // chunk == j // chunk): a chunk of
        # at least the span masks nothing.
        yield from _masked_layers(config, "attention_chunk_size", chunk, "chunked_attention", "chunked attention")


def _passes_window(modules: list[tuple[str, nn.Module]]) -> bool:
    """Whether every attention layer hands its window to the attention function, read from
    the source of its class's ``forward``: it passes ``sliding_window=`` (Mistral's
    ``sliding_window=getattr(self.config, "sliding_window", None)``, Qwen2's
    ``sliding_window=self.sliding_window``). Qwen2-MoE and PhiMoE do not: their window lives
    in the mask only (Qwen2-MoE even sets a ``sliding_window`` attribute it never passes,
    so the attribute cannot tell them apart; the call can). Source that cannot be read
    counts as not passing: refused, never silently wrong."""
    classes = {
        type(m) for path, m in modules
        if type(m).__name__.endswith("Attention") and not type(m).__module__.startswith("torch.")
        and not any(_TOWER.search(part) for part in path.split("."))
    }
    if not classes:
        return False
    for cls in classes:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            return False
        if not re.search(r"\bsliding_window\s*=(?!=)", source):
            return False
    return True


def _masked_layers(
    config: Any, field: str, size: int, kind: str, what: str, measure: str = "span"
) -> Iterator[_Bound]:
    """The bound of a window or chunk of ``size`` tokens on the layers of ``kind`` (every
    layer when the config has no layer_types: Mistral, Mixtral, PhiMoE, Starcoder2);
    ``measure`` ``"packed"`` where the ring computes it on dense rows."""
    kinds = _first(config, "layer_types")
    layers = [i for i, k in enumerate(kinds) if k == kind] if isinstance(kinds, (list, tuple)) else None
    if layers == []:
        return
    on = "every layer" if layers is None else f"layers {_listed([str(i) for i in layers], 8)}"
    if measure == "packed":
        message = (
            f"config.{field}={size} gives {on} {what} of {size} tokens, which ring_flash computes "
            "on dense rows but not yet {where} (packed rows); this forward's longest document has "
            "{length} tokens. Use documents of at most {limit} tokens, or dense rows (no packing)"
        )
    else:
        message = (
            f"config.{field}={size} gives {on} {what} of {size} tokens, which {{where}} ring_flash does "
            "not compute (the model applies it through its mask only, not by passing it to the "
            "attention function, so ring_flash attends to the whole causal past); this forward's "
            "longest sequence (document) has {length} tokens. Use sequences of at most {limit} "
            "tokens, or train without context parallelism and without packed rows"
        )
    yield _Bound(size + 1, measure, message)


def _temperature_bounds(config: Any) -> Iterator[_Bound]:
    """Llama 4's attention temperature tuning on NoPE layers scales each query by
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, with p numbered 0.. over the
    tokens the forward holds (the local shard under CP, the whole row in packed rows):
    exact while every p + 1 < floor_scale, where the scale is 1 whatever p."""
    if not any(_config_values(config, "attn_temperature_tuning")):
        return
    no_rope = _first(config, "no_rope_layers")
    # no_rope_layers[i] == 0 marks a NoPE layer (1: RoPE is used).
    nope = [i for i, use_rope in enumerate(no_rope or []) if not use_rope]
    floor_scale = _smallest(config, "floor_scale")
    if not nope:
        return
    yield _Bound(
        floor_scale or 0,
        "row",
        f"Llama 4 attention temperature tuning (config.attn_temperature_tuning) on NoPE layers "
        f"{_listed([str(i) for i in nope], 8)} scales queries by a position the model numbers from 0 "
        "over the tokens it holds, so {where} it would use local positions, not the sequence's; it is "
        "exact only for rows of at most {limit} tokens (config.floor_scale) and this one has {length}. "
        "Use shorter rows, or train without context parallelism and without packed rows",
    )

