"""The contract every attention-block backend follows, and the one check they all share.

Kept apart from the registry so that backend modules can build their record from it
without importing the registry (which imports them to register the built-ins).

A backend computes one block of attention, ``(q, k, v, causal, scale) -> (out, lse)``, and
its backward ``(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``:

- ``q``, ``dout``, ``out``: ``(batch, q_len, n_heads, head_dim)``; ``k``, ``v``:
  ``(batch, k_len, n_kv_heads, head_dim)``, all of one floating dtype (``out`` may come
  back in float32 from the merge; backends cast it). ``n_heads % n_kv_heads == 0`` (GQA):
  backends that cannot take that natively repeat K/V locally, on the already-received
  block, never before communication.
- ``lse``: ``(batch, n_heads, q_len)``, natural-log units, float32 (float64 for float64
  inputs); in the backward it is the *final* lse of each query row, possibly a
  non-contiguous column slice of a wider tensor.
- ``causal`` blocks always have ``q_len == k_len`` (top-left and bottom-right alignment
  agree); non-causal ones may differ.
- ``dq``, ``dk``, ``dv``: shaped like q, k, v, in the input dtype or float32.

A backend may also offer a variable-length kernel: many independent blocks in one call,
rows concatenated. ``q`` ``(total_q, n_heads, head_dim)``, ``k``/``v`` ``(total_k,
n_kv_heads, head_dim)``, boundaries ``cu_q``/``cu_k`` int32 ``(n_blocks + 1,)`` on the
tensors' device, ``max_q``/``max_k`` Python ints, lse ``(n_heads, total_q)`` float32.
Packed rows use it to run every document of a ring step in one launch. Its causal blocks
have equal lengths, except on a backend that declares ``varlen_causal_bottom_right``: there
a causal block's queries may be fewer than its keys, the mask aligned to the bottom right
(query ``i`` of ``q_len`` sees keys ``0 .. k_len - q_len + i``, flash-attn's rule since
2.1), and the all-gather pattern runs a packed row's local chunk of every document against
each document's prefix in one call.

A backend may also offer a masked kernel, for blocks on the edge of a sliding window:
``masked_forward(q, k, v, mask, scale) -> (out, lse)`` and ``masked_backward(dout, q, k,
v, out, lse, mask, scale) -> (dq, dk, dv)``, shapes as above, ``mask`` bool ``(q_len,
k_len)`` on the tensors' device, True where the key is visible (it replaces ``causal``).
A query row with no visible key gets ``out = 0``, ``lse = -inf`` and zero gradients, so
merging it changes nothing.

A backend may also take logit softcapping (Gemma 2): then its forward, backward and
masked kernels accept a keyword ``softcap`` (a positive float), with which the scores
become ``softcap * tanh(scores / softcap)`` before the mask and the softmax, and the
backward differentiates through the tanh. Callers pass the keyword only when capping.

Asking for a backend that cannot run on this machine, device or dtype is an error that
says what to do: a different kernel would be a silent change of numerics and speed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# (q, k, v, causal, scale) -> (out, lse)
ForwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
# (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
BackwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]
# (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse)
VarlenForwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
# (dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)
VarlenBackwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]
# (q, k, v, mask, scale) -> (out, lse)
MaskedForwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
# (dout, q, k, v, out, lse, mask, scale) -> (dq, dk, dv)
MaskedBackwardFn = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]
# Raises ValueError / NotImplementedError, saying why, when the backend cannot run here.
ProbeFn = Callable[[torch.device, torch.dtype], None]

ALL_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
HALF_FLOATS = (torch.float16, torch.bfloat16)
# bfloat16 kernels need Ampere whatever the backend's own minimum.
_BF16_MIN_CAPABILITY = (8, 0)


def _always_installed() -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class AttentionBackend:
    """A named block kernel, the devices and dtypes it takes, and how to tell it can run.

    Fields:
        name: what users pass as ``backend=``.
        forward, backward: the block kernel (see the module docstring for shapes).
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        dtypes: input dtypes it takes.
        description: one line for listings.
        installed: whether its package is importable; cheap, no import side effects.
        install_hint: what to do when ``installed()`` is False (e.g. ``pip install ...``).
        min_capability: lowest CUDA compute capability it runs on; None for no minimum.
        max_head_dim: largest head_dim its kernels take; None for no limit.
        probe: further checks known before any tensor exists (package version, kernel
            signature); raises ValueError / NotImplementedError saying what to do.
        varlen_forward, varlen_backward: the optional variable-length kernel; both or neither.
        varlen_causal_bottom_right: whether its varlen kernel takes causal blocks with fewer
            queries than keys, aligned to the bottom right (see the module docstring).
        masked_forward, masked_backward: the optional kernel with an explicit boolean mask
            (sliding windows inside the ring); both or neither.
        softcap: whether its kernels take the ``softcap=`` keyword (see the module docstring).
        slow_on: device types on which it is a slow fallback (it materialises the score
            matrix there); ``backend="auto"`` logs once when it has to take it on one.
        batched_views: whether its forward and backward take q, k, v, dout, out and lse
            as strided views whose batch entries lie anywhere in one row's storage (any
            batch stride); packed rows then run equal documents' blocks as one call.
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    description: str
    installed: Callable[[], bool] = _always_installed
    install_hint: str = ""
    min_capability: Optional[tuple[int, int]] = None
    max_head_dim: Optional[int] = None
    probe: Optional[ProbeFn] = None
    varlen_forward: Optional[VarlenForwardFn] = None
    varlen_backward: Optional[VarlenBackwardFn] = None
    varlen_causal_bottom_right: bool = False
    masked_forward: Optional[MaskedForwardFn] = None
    masked_backward: Optional[MaskedBackwardFn] = None
    softcap: bool = False
    slow_on: tuple[str, ...] = ()
    batched_views: bool = False

    def __post_init__(self) -> None:
        if (self.varlen_forward is None) != (self.varlen_backward is None):
            raise ValueError(f"attention backend {self.name!r}: give both varlen_forward and "
                             "varlen_backward, or neither")
        if self.varlen_causal_bottom_right and self.varlen_forward is None:
            raise ValueError(f"attention backend {self.name!r}: varlen_causal_bottom_right describes a varlen "
                             "kernel; give varlen_forward and varlen_backward")
        if (self.masked_forward is None) != (self.masked_backward is None):
            raise ValueError(f"attention backend {self.name!r}: give both masked_forward and "
                             "masked_backward, or neither")

    @property
    def masked(self) -> bool:
        """Whether it has the masked kernel (sliding windows inside the ring)."""
        return self.masked_forward is not None

    def lacks(self, needs: "KernelNeeds") -> list[str]:
        """What of ``needs`` this backend does not compute (empty: it computes all)."""
        missing = [what for what, needed, has in (("a masked kernel", needs.masked, self.masked),
                                                  ("logit softcapping", needs.softcap, self.softcap))
                   if needed and not has]
        if needs.head_dim is not None and self.max_head_dim is not None and needs.head_dim > self.max_head_dim:
            missing.append(f"head_dim {needs.head_dim}")
        return missing

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ValueError (saying what to do) unless this backend runs on ``device`` for
        ``dtype``: device type, dtype, GPU generation, then ``probe``.

        The one check every backend uses, at selection and, for the CUDA kernels, before
        each launch (everything it reads is cached after the first call).
        """
        hint = "pass backend='auto' or one of hf_ring.kernels.available_backends(device, dtype)"
        if device.type not in self.devices:
            raise ValueError(f"attention backend {self.name!r} runs on {'/'.join(self.devices)}, but the "
                             f"tensors are on {device}; {hint}")
        if dtype not in self.dtypes:
            raise ValueError(f"attention backend {self.name!r} takes {[str(d) for d in self.dtypes]}, "
                             f"got {dtype}; cast the model (e.g. torch_dtype=torch.bfloat16) or {hint}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"attention backend {self.name!r}: no CUDA device is available here "
                             f"(PyTorch {torch.__version__}); {hint}")
        if device.type == "cuda" and self.min_capability is not None:
            need = max(self.min_capability, _BF16_MIN_CAPABILITY) if dtype == torch.bfloat16 \
                else self.min_capability
            have = gpu_capability(device)
            if have < need:
                raise ValueError(f"attention backend {self.name!r} needs a GPU of compute capability "
                                 f">= {need[0]}.{need[1]} for {dtype}, this one is {have[0]}.{have[1]}; "
                                 f"{hint}")
        if self.probe is not None:
            self.probe(device, dtype)


@dataclass(frozen=True)
class KernelNeeds:
    """What one attention call needs of its block kernel besides device and dtype.

    Fields:
        masked: a masked kernel: a sliding window shorter than the sequence (the blocks on
            its edge), or a ring over token sets no layout describes (the hybrid pattern
            under the stripe layout).
        softcap: logit softcapping (Gemma 2's ``attn_logit_softcapping``).
        head_dim: the call's head size, which a kernel with a ``max_head_dim`` must take
            (None: not known yet, checked at launch).

    Sinks and packed rows need nothing of the kernel: sinks are merged into the softmax
    after the blocks, and packed rows run per document where a backend has no varlen kernel.
    """

    masked: bool = False
    softcap: bool = False
    head_dim: Optional[int] = None

    def describe(self) -> str:
        """The features needed, in words, for messages; empty when there are none."""
        return " and ".join(w for w, on in (("a masked kernel", self.masked), ("logit softcapping", self.softcap))
                            if on)


@functools.lru_cache(maxsize=None)  # a driver query; checked before every CUDA launch
def gpu_capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability ``(major, minor)`` of ``device``."""
    return torch.cuda.get_device_capability(device)
