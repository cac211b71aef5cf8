"""``ContextParallel.wrap``: context parallelism for any attention module that calls
``torch.nn.functional.scaled_dot_product_attention`` (SDPA), without touching its code.

Why: users with their own model (not a Hugging Face one) have an attention block that
projects, applies RoPE, and calls SDPA. Under context parallelism each rank holds a shard
of the sequence; everything in such a block is per token except the SDPA call. So the
wrapper runs the block unchanged on the rank's shard (the caller passes the global
positions where the block uses them, e.g. for RoPE) and routes each SDPA call made during
the wrapped forward to :func:`hf_ring.context_parallel_attn_func` over the CP group.

The interception is a ``TorchFunctionMode`` pushed for the wrapped forward only: torch
keeps its mode stack per thread, so SDPA calls on other threads, and calls after the
forward returns, are untouched. A thread-local flag keeps a routed call from being routed
again by an enclosing wrapper (nested wrapped modules). What cannot be exact is refused:
an ``attn_mask`` (the shard's mask is not the sequence's), ``dropout_p > 0``, ``is_causal``
that contradicts ``causal=``, cross-attention or a KV cache (keys of another length than
the queries), and a wrapped forward that never called SDPA under CP (its attention ran
over the shard alone).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hf_ring.distributed.active import resolve_cp_group
from hf_ring.distributed.groups import group_coords
from hf_ring.kernels.autocast import one_dtype
from hf_ring.patterns.state import check_pattern
from hf_ring.patterns.api import context_parallel_attn_func
from hf_ring.sharding.layouts import check_layout, shard_indices, shard_sequence

_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_ROUTING = threading.local()


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """SDPA's arguments by name, defaults filled in."""
    if len(args) > len(_SDPA_PARAMETERS):
        raise TypeError(f"scaled_dot_product_attention takes at most {len(_SDPA_PARAMETERS)} positional arguments")
    bound = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_PARAMETERS, args)), **kwargs}
    unknown = set(bound) - set(_SDPA_PARAMETERS)
    if unknown:
        raise TypeError(f"scaled_dot_product_attention got unexpected arguments {sorted(unknown)}")
    return bound


def _routed_calls() -> int:
    return getattr(_ROUTING, "calls", 0)


class _RouteSDPA(TorchFunctionMode):
    """Routes SDPA calls to the wrapper's context-parallel attention; passes the rest through."""

    def __init__(self, wrapper: "ContextParallel") -> None:
        super().__init__()
        self.wrapper = wrapper

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or getattr(_ROUTING, "active", False):
            return func(*args, **kwargs)
        # Counted per thread, so that a wrapper around a wrapped module sees the calls the
        # inner one routed.
        _ROUTING.calls = _routed_calls() + 1
        _ROUTING.active = True
        try:
            return self.wrapper._attend(_sdpa_arguments(args, kwargs))
        finally:
            _ROUTING.active = False


class ContextParallel(nn.Module):
    """An attention module run with context parallelism (build it with :meth:`wrap`).

    Attributes:
        module: the wrapped attention module (its parameters are this module's, under
            ``module.``).
        cp_group: the context-parallel process group (None: the active state's CP group when
            one is set up, else the default group; read at each call).
        pattern: how attention is split across the group, as in
            :func:`hf_ring.context_parallel_attn_func`, or ``"auto"`` (picked per call from
            the head counts, the length and the group's size and placement,
            hf_ring/patterns/auto.py).
        ulysses_size: ``pattern="hybrid"`` only: ranks per Ulysses group.
        causal: whether the module's attention is causal (its SDPA calls must say
            ``is_causal=causal``).
        layout: how the caller sharded the sequence (``hf_ring.shard_sequence``).
        backend: the block kernel, ``"auto"`` or a name from
            ``hf_ring.kernels.available_backends``.
    """

    def __init__(
        self,
        module: nn.Module,
        cp_group: Optional[dist.ProcessGroup] = None,
        pattern: str = "ring",
        causal: bool = True,
        layout: str = "zigzag",
        backend: str = "auto",
        ulysses_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ContextParallel.wrap needs an nn.Module, got {type(module).__name__}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        check_layout(layout)
        self._cp_group = cp_group
        check_pattern(pattern, ulysses_size, group_coords(self.cp_group)[1])
        self.module = module
        self.pattern = pattern
        self.causal = causal
        self.layout = layout
        self.backend = backend
        self.ulysses_size = ulysses_size

    @classmethod
    def wrap(
        cls,
        inner_attention: nn.Module,
        cp_group: Optional[dist.ProcessGroup] = None,
        pattern: str = "ring",
        causal: bool = True,
        *,
        layout: str = "zigzag",
        backend: str = "auto",
        ulysses_size: Optional[int] = None,
    ) -> "ContextParallel":
        """Wrap ``inner_attention``, whose forward calls ``scaled_dot_product_attention``
        on ``(batch, heads, seq, head_dim)`` tensors, for context parallelism over
        ``cp_group``: called with this rank's shard of the sequence (sharded with
        ``hf_ring.shard_sequence(..., layout=layout)``; positions the module uses, e.g. for
        RoPE, must be the shard's global ones, :meth:`positions`), the wrapped module
        returns this rank's shard of what ``inner_attention`` returns on the full sequence,
        with the same gradients. Every rank of the group must call it together, with
        tensors of the same shapes."""
        return cls(inner_attention, cp_group, pattern, causal, layout, backend, ulysses_size)

    @property
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """The group the attention runs over: the one given to ``wrap``, or with none given
        the CP group of the state active at the call (``setup_context_parallel``; resolved on
        every use, so a state set up after wrapping counts), else the default group."""
        return resolve_cp_group(self._cp_group, "hf_ring.ContextParallel")

    @property
    def cp_rank_and_size(self) -> tuple[int, int]:
        return group_coords(self.cp_group)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full-sequence tensor ``x`` (sequence along ``dim``)."""
        rank, world = self.cp_rank_and_size
        return shard_sequence(x, world, rank, dim=dim, layout=self.layout)

    def positions(self, seq_len: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """The global positions of this rank's tokens of a ``seq_len``-token sequence,
        ``(seq_len // cp_size,)`` int64: what a RoPE inside the module must use."""
        rank, world = self.cp_rank_and_size
        return shard_indices(seq_len, world, rank, self.layout).to(device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        before = _routed_calls()
        with _RouteSDPA(self):
            out = self.module(*args, **kwargs)
        if _routed_calls() == before and self.cp_rank_and_size[1] > 1:
            raise RuntimeError(
                f"{type(self.module).__name__} made no call to torch.nn.functional.scaled_dot_product_attention "
                "in its forward, so ContextParallel could not run its attention across the context-parallel "
                "group: whatever attention it computed saw this rank's shard only. Make the module call SDPA "
                "(on (batch, heads, seq, head_dim) tensors), or call hf_ring.context_parallel_attn_func directly"
            )
        return out

    def _refuse(self, a: dict[str, Any]) -> None:
        name = type(self.module).__name__
        q, k, v = a["query"], a["key"], a["value"]
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            raise ValueError(
                f"{name} called scaled_dot_product_attention with tensors of shapes "
                f"{[tuple(getattr(t, 'shape', ())) for t in (q, k, v)]}; ContextParallel takes "
                "(batch, heads, seq, head_dim) only"
            )
        if a["attn_mask"] is not None:
            raise NotImplementedError(
                f"{name} passed attn_mask to scaled_dot_product_attention; under context parallelism a "
                "mask built on this rank's shard is not the sequence's, so ContextParallel refuses it. "
                "Use is_causal=True (with ContextParallel.wrap(..., causal=True)) instead of a causal mask; "
                "other masks (padding, documents) are not supported"
            )
        if a["dropout_p"]:
            raise NotImplementedError(
                f"{name} asked scaled_dot_product_attention for dropout_p={a['dropout_p']}, which "
                "ContextParallel does not compute; pass dropout_p=0.0 (e.g. `self.p if self.training "
                "else 0.0` with the module in eval mode, or p=0)"
            )
        if bool(a["is_causal"]) != self.causal:
            raise ValueError(
                f"{name} called scaled_dot_product_attention with is_causal={a['is_causal']} but was wrapped "
                f"with causal={self.causal}; wrap it with causal={bool(a['is_causal'])} if that is what it "
                "computes"
            )
        if not q.shape[2] == k.shape[2] == v.shape[2]:
            raise NotImplementedError(
                f"{name} attends {q.shape[2]} queries to {k.shape[2]} keys: ContextParallel computes "
                "self-attention over the sharded sequence only (no cross-attention, no KV cache)"
            )
        if k.shape[1] != q.shape[1] and not a["enable_gqa"]:
            raise ValueError(
                f"{name} passed {q.shape[1]} query heads and {k.shape[1]} key heads without enable_gqa=True, "
                "which scaled_dot_product_attention itself refuses"
            )

    def _attend(self, a: dict[str, Any]) -> torch.Tensor:
        """One SDPA call, ``(batch, heads, seq_local, head_dim)`` in and out, over the group."""
        self._refuse(a)
        q, k, v = (t.transpose(1, 2) for t in one_dtype(a["query"], a["key"], a["value"]))

        out = context_parallel_attn_func(
            q, k, v, group=self.cp_group, pattern=self.pattern, causal=self.causal, softmax_scale=a["scale"],
            layout=self.layout, ulysses_size=self.ulysses_size, backend=self.backend,
        )
        return out.transpose(1, 2)


__all__ = ["ContextParallel"]
