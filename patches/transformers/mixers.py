"""Routes the token-mixer layers of transformers 5.x's hybrid and recurrent models to
hf_ring's context-parallel token mixers.

Why: these layers (gated delta nets, Mamba-2 and Mamba-1 mixers, Kimi delta attention,
LFM2's short convolutions) mix tokens with module-level functions of their modeling
module (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``,
``mamba_selective_scan``, ``chunk_kimi_delta_attention``) that would see only this rank's
shard under context parallelism. ``route`` replaces those names in the modeling module
with wrappers, the layer's ``forward`` with one that tells the wrappers which layer calls
them, and the fused GPU shortcuts (``mamba2_split_conv1d_scan_combined``,
``mamba_inner_fn``: a whole layer in one kernel call) with wrappers that can decline. What
the wrappers do (the CP op, or the original function unchanged) is passed in by hf_ring's
transformers integration.

Where a layer is called without the model's keyword arguments (the Mamba-1 mixers inside
their blocks), ``ROUTES`` names the class whose forward still receives them (its carrier),
which is wrapped too; where the model with its head drops them before its base model
(the pure Mamba models), the head's forward is wrapped so that they can still be read.

Written for transformers 5.24.0 and 5.25.0: each modeling module below, its classes, and
the parameters of every function are checked before anything is replaced; on another
release line (4.57.x) or another shape nothing is routed and the layers stay refused under
CP. Two things changed in 5.25: transformers now requires ``kernels`` (0.19), whose
``use_kernel_forward_from_hub`` turns each of these decorated functions into an instance of
a ``Func`` ``nn.Module`` whose ``forward(*args, **kwargs)`` calls the function (its closure's
``func``, read in kernels 0.19.1), so the parameters are read from that function; and
FalconMamba's mixer lost its fused ``mamba_inner_fn`` path, so a route's fused shortcut is
wrapped only where the modeling module still defines it.

Owns: ``ROUTES``, ``route``, ``is_routed``, ``route_of``, ``mark_routed``, ``unmark_routed``, ``is_routed_layer``. Must not import hf_ring.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from .versions import installed_version, release_line

_MARK = "_hf_ring_routed_mixer"
# Set on each layer of a model hf_ring routed (the class alone is not enough: another
# model of the same family, not built for hf_ring, has no guard checking its layers).
_ROUTED_LAYER = "_hf_ring_routed_layer"


@dataclass(frozen=True)
class Route:
    """How one family's token-mixer layer reaches hf_ring.

    Attributes:
        layer: the mixer layer class.
        runs: the module functions its forward must run on hf_ring's path in every forward
            under CP (the guard checks each).
        fused: module functions that compute the whole layer in one GPU kernel when one
            is installed, and return None otherwise; under CP they must return None.
        carrier: the class whose forward receives the model's keyword arguments when the
            layer's own does not (its caller drops them), or None.
        head: the model-with-head class whose forward drops its keyword arguments (the
            positions, a packed row's lengths) instead of handing them to its base model,
            or None.
    """

    layer: str
    runs: tuple[str, ...]
    fused: tuple[str, ...] = ()
    carrier: Optional[str] = None
    head: Optional[str] = None


_GDN = GATED_DELTA_NET = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
_MAMBA2 = ("causal_conv1d_fn", "mamba2_chunk_scan")
_MAMBA1 = ("causal_conv1d_fn", "mamba_selective_scan")
_KDA = ("causal_conv1d_fn", "chunk_kimi_delta_attention")
SHORT_CONV = ("causal_conv1d_fn",)
_M = "transformers.models."
# Modeling module -> its token-mixer layer (transformers 5.24.0).
ROUTES: dict[str, Route] = {
    _M + "qwen3_5.modeling_qwen3_5": Route("Qwen3_5GatedDeltaNet", _GDN),
    _M + "qwen3_5_moe.modeling_qwen3_5_moe": Route("Qwen3_5MoeGatedDeltaNet", _GDN),
    _M + "qwen3_next.modeling_qwen3_next": Route("Qwen3NextGatedDeltaNet", _GDN),
    _M + "olmo_hybrid.modeling_olmo_hybrid": Route("OlmoHybridGatedDeltaNet", _GDN),
    _M + "lara_mini.modeling_lara_mini": Route("LaraMiniGatedDeltaNet", _GDN),
    _M + "qwen4_exp.modeling_qwen4_exp": Route("Qwen4ExpTextGatedDeltaNet", _GDN),
    _M + "mamba2.modeling_mamba2": Route(
        "Mamba2Mixer", _MAMBA2, ("mamba2_split_conv1d_scan_combined",), head="Mamba2ForCausalLM"),
    _M + "bamba.modeling_bamba": Route("BambaMixer", _MAMBA2, ("mamba2_split_conv1d_scan_combined",)),
    _M + "granitemoehybrid.modeling_granitemoehybrid": Route(
        "GraniteMoeHybridMambaLayer", _MAMBA2, ("mamba2_split_conv1d_scan_combined",)),
    _M + "nemotron_h.modeling_nemotron_h": Route(
        "NemotronHMamba2Mixer", _MAMBA2, ("mamba2_split_conv1d_scan_combined",)),
    _M + "falcon_h1.modeling_falcon_h1": Route("FalconH1Mixer", _MAMBA2, ("mamba2_split_conv1d_scan_combined",)),
    _M + "zamba2.modeling_zamba2": Route("Zamba2MambaMixer", _MAMBA2, ("mamba2_split_conv1d_scan_combined",)),
    _M + "mamba.modeling_mamba": Route(
        "MambaMixer", _MAMBA1, ("mamba_inner_fn",), carrier="MambaModel", head="MambaForCausalLM"),
    _M + "falcon_mamba.modeling_falcon_mamba": Route(
        "FalconMambaMixer", _MAMBA1, ("mamba_inner_fn",), carrier="FalconMambaModel", head="FalconMambaForCausalLM"),
    _M + "jamba.modeling_jamba": Route("JambaMambaMixer", _MAMBA1, carrier="JambaMambaDecoderLayer"),
    _M + "zamba.modeling_zamba": Route("ZambaMambaMixer", _MAMBA1),
    _M + "lfm2.modeling_lfm2": Route("Lfm2ShortConv", SHORT_CONV),
    _M + "lfm2_moe.modeling_lfm2_moe": Route("Lfm2MoeShortConv", SHORT_CONV),
    _M + "lfm3.modeling_lfm3": Route("Lfm3ShortConv", SHORT_CONV),
    _M + "kimi_linear.modeling_kimi_linear": Route("KimiLinearDeltaAttention", _KDA),
    _M + "bailing_hybrid.modeling_bailing_hybrid": Route("BailingHybridDeltaAttention", _KDA),
    _M + "glm5_next.modeling_glm5_next": Route("Glm5NextTextLinearAttention", _KDA),
}
# The parameters each function was written for (its first ones; the rest must have defaults).
_PARAMETERS = {
    "causal_conv1d_fn": ("hidden_states", "weight", "bias", "activation", "kwargs"),
    "torch_chunk_gated_delta_rule": (
        "query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "kwargs",
    ),
    "mamba2_chunk_scan": (
        "hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states", "dt_softplus",
        "dt_limit", "return_final_states", "kwargs",
    ),
    "mamba_selective_scan": (
        "hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state",
        "use_mambapy", "use_associative_scan", "kwargs",
    ),
    "chunk_kimi_delta_attention": (
        "query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "kwargs",
    ),
    "mamba2_split_conv1d_scan_combined": ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D"),
    "mamba_inner_fn": ("xz", "conv1d_weight", "conv1d_bias", "x_proj_weight", "delta_proj_weight"),
}


def _unwrapped(fn):
    return getattr(fn, "original", fn)


def _function_of(fn) -> Optional[Callable]:
    """The Python function behind a module-level name: itself, or, where ``kernels`` made the
    function a ``Func`` module (transformers 5.25), the ``func`` its ``forward`` calls; None
    for anything of another shape (its parameters could not be checked)."""
    if inspect.isfunction(fn):
        return fn
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if type(fn).__name__ != "Func" or code is None or "func" not in code.co_freevars:
        return None
    inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return inner if inspect.isfunction(inner) else None


def _fused_present(module, route: Route) -> tuple[str, ...]:
    """The route's fused shortcuts the modeling module defines (5.25's FalconMamba has none)."""
    return tuple(name for name in route.fused if name in vars(module))


def _shape_ok(module, route: Route) -> bool:
    """Whether ``module`` and its classes have the shape the wrappers were written for."""
    names = route.runs + _fused_present(module, route)
    for name in names:
        fn = _function_of(_unwrapped(vars(module).get(name)))
        if fn is None:
            return False
        params = tuple(inspect.signature(fn).parameters)
        if params[:len(_PARAMETERS[name])] != _PARAMETERS[name]:
            return False
    classes = [getattr(module, name, None) for name in (route.layer, route.carrier, route.head) if name]
    if any(not isinstance(c, type) for c in classes):
        return False
    try:
        source = _calls_source(module, inspect.getsource(_unwrapped(classes[0].forward)))
    except (OSError, TypeError):
        return False
    # A fused shortcut the module no longer defines must not be called by the layer either.
    absent = [name for name in route.fused if name not in names]
    return all(f"{name}(" in source for name in names) and not any(f"{name}(" in source for name in absent)


def _calls_source(module, source: str) -> str:
    """``source`` with the source of every function of ``module`` it calls by name appended:
    5.25's layers call the convolution and the scan through helpers of their modeling module
    (``causal_conv1d_forward``, ``mamba2_scan_forward``, ``mamba_scan_forward``: ``Func``
    modules too), which call the module's ``causal_conv1d_fn`` / ``mamba2_chunk_scan`` /
    ``mamba_selective_scan`` by their global names, so replacing those names still routes
    them (and should a Hub kernel replace a helper, the guard finds the layer did not run
    hf_ring's path). One level deep, as read in 5.25.0."""
    # _unwrapped: a name hf_ring already replaced is read as what it replaced.
    helpers = [_function_of(_unwrapped(value)) for name, value in vars(module).items() if f"{name}(" in source]
    return "\n".join([source, *(inspect.getsource(fn) for fn in helpers
                                 if fn is not None and fn.__module__ == module.__name__)])


def _wrap(owner, name: str, runner: Callable, method: bool) -> None:
    original = getattr(owner, name) if method else vars(owner)[name]
    if getattr(original, _MARK, False):
        return

    if method:
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            return runner(original, self, *args, **kwargs)
    else:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return runner(original, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    wrapper.original = original
    setattr(owner, name, wrapper)


def route_of(cls: type) -> Optional[Route]:
    """The route of ``cls`` when it is a mixer layer class of ``ROUTES``, else None."""
    route = ROUTES.get(cls.__module__)
    return route if route is not None and route.layer == cls.__name__ else None


def route(cls: type, layer: Callable, carrier: Callable, head: Callable, functions: Mapping[str, Callable]) -> bool:
    """Route ``cls`` (a token-mixer layer class) through the given runners; idempotent.

    Args:
        cls: a layer class; only those of ``ROUTES`` are routed.
        layer: ``layer(original_forward, module, *args, **kwargs)``, run as the layer's forward.
        carrier: ``carrier(original_forward, module, *args, **kwargs)``, run as the forward of
            the route's carrier class, if it has one.
        head: ``head(original_forward, module, *args, **kwargs)``, run as the forward of the
            route's head class, if it has one.
        functions: by function name, ``runner(original, *args, **kwargs)`` run in place of
            that module function (every name of the route's ``runs`` and ``fused``).

    Returns:
        True when ``cls`` is routed; False for any other class, another release line than
        5.x, or a modeling module whose shape differs from 5.24.0's and 5.25.0's.
    """
    spec = route_of(cls)
    if spec is None or release_line(installed_version()) != "5":
        return False
    module = importlib.import_module(cls.__module__)
    if getattr(module, cls.__name__, None) is not cls or not _shape_ok(module, spec):
        return False
    for name in spec.runs + _fused_present(module, spec):
        _wrap(module, name, functions[name], method=False)
    for name, runner in ((spec.carrier, carrier), (spec.head, head)):
        if name:
            _wrap(getattr(module, name), "forward", runner, method=True)
    _wrap(cls, "forward", layer, method=True)
    return True


def is_routed(cls: type) -> bool:
    """Whether ``cls``'s forward and the functions it calls go through hf_ring's runners."""
    spec = route_of(cls)
    if spec is None or not getattr(cls.__dict__.get("forward"), _MARK, False):
        return False
    module = importlib.import_module(cls.__module__)
    carried = all(getattr(getattr(module, name).__dict__.get("forward"), _MARK, False)
                  for name in (spec.carrier, spec.head) if name)
    return carried and all(getattr(vars(module).get(name), _MARK, False)
                           for name in spec.runs + _fused_present(module, spec))


def mark_routed(module) -> None:
    """Note on ``module`` itself that its model routes and guards it."""
    module.__dict__[_ROUTED_LAYER] = True


def unmark_routed(module) -> None:
    """Undo ``mark_routed`` (a module that runs outside the sharded sequence)."""
    module.__dict__.pop(_ROUTED_LAYER, None)


def is_routed_layer(module) -> bool:
    """Whether ``module`` was marked by ``mark_routed`` and its class is routed."""
    return bool(module.__dict__.get(_ROUTED_LAYER)) and is_routed(type(module))
