"""Routes the gated delta net layers of transformers 5.x to hf_ring's context-parallel
token mixers.

Why: a gated delta net layer (Qwen3.5 dense and MoE, Qwen3-Next, OLMo hybrid) mixes tokens
with a causal depthwise convolution and the gated delta rule, which it calls as the
module-level functions ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` of its
modeling module, handing them the layer's ``**kwargs`` (hf_ring's forward context among
them). Under context parallelism each would see only this rank's shard; ``route`` replaces
those two names in the modeling module with wrappers, and the layer's ``forward`` with one
that tells the wrappers which layer calls them. What the wrappers do (the CP op, or the
original function unchanged) is passed in by hf_ring's transformers integration.

Written for transformers 5.24.0: each modeling module below, its layer class, and the
parameters of both functions are checked before anything is replaced; on another release
line (4.57.x) or another shape nothing is routed and the layers stay refused under CP.

Owns: ``GATED_DELTA_NETS``, ``route``, ``is_routed``. Must not import hf_ring.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable

from .versions import installed_version, release_line

_MARK = "_hf_ring_routed_mixer"
# Modeling module -> its gated delta net layer class (transformers 5.24.0).
GATED_DELTA_NETS = {
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "transformers.models.qwen3_next.modeling_qwen3_next": "Qwen3NextGatedDeltaNet",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid": "OlmoHybridGatedDeltaNet",
}
# The functions each layer's forward calls, with the parameters they were written for.
_FUNCTIONS = {
    "causal_conv1d_fn": ["hidden_states", "weight", "bias", "activation", "kwargs"],
    "torch_chunk_gated_delta_rule": [
        "query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "kwargs",
    ],
}


def _shape_ok(module, cls) -> bool:
    """Whether ``module`` and its layer class have the shape these wrappers were written for."""
    for name, params in _FUNCTIONS.items():
        fn = vars(module).get(name)
        fn = getattr(fn, "original", fn)
        if not callable(fn) or list(inspect.signature(fn).parameters) != params:
            return False
    forward = getattr(cls.forward, "original", cls.forward)
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return all(f"{name}(" in source for name in _FUNCTIONS) and "**kwargs" in source


def _wrap_function(module, name: str, runner: Callable) -> None:
    original = vars(module)[name]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        return runner(original, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    wrapper.original = original
    setattr(module, name, wrapper)


def _wrap_forward(cls, runner: Callable) -> None:
    original = cls.forward
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return runner(original, self, *args, **kwargs)

    setattr(forward, _MARK, True)
    forward.original = original
    cls.forward = forward


def route(cls: type, layer: Callable, conv: Callable, delta_rule: Callable) -> bool:
    """Route ``cls`` (a gated delta net layer class) through the given runners; idempotent.

    Args:
        cls: a layer class; only those of ``GATED_DELTA_NETS`` are routed.
        layer: ``layer(original_forward, module, *args, **kwargs)``, run as the layer's forward.
        conv: ``conv(original, hidden_states (batch, channels, seq), weight (channels, width),
            bias, activation=None, **kwargs)`` in place of ``causal_conv1d_fn``.
        delta_rule: ``delta_rule(original, query, key, value, g=, beta=, ..., **kwargs)`` in
            place of ``torch_chunk_gated_delta_rule`` (q, k ``(batch, seq, heads, k_dim)``).

    Returns:
        True when ``cls`` is routed; False for any other class, another release line than
        5.x, or a modeling module whose shape differs from 5.24.0's.
    """
    if GATED_DELTA_NETS.get(cls.__module__) != cls.__name__ or release_line(installed_version()) != "5":
        return False
    module = importlib.import_module(cls.__module__)
    if getattr(module, cls.__name__, None) is not cls or not _shape_ok(module, cls):
        return False
    _wrap_function(module, "causal_conv1d_fn", conv)
    _wrap_function(module, "torch_chunk_gated_delta_rule", delta_rule)
    _wrap_forward(cls, layer)
    return True


def is_routed(cls: type) -> bool:
    """Whether ``cls``'s forward and the functions it calls go through hf_ring's runners."""
    if not getattr(cls.__dict__.get("forward"), _MARK, False):
        return False
    module = importlib.import_module(cls.__module__)
    return all(getattr(vars(module).get(name), _MARK, False) for name in _FUNCTIONS)
