"""Random draws under context parallelism: each token gets the mask or noise that one process
running the full sequence gives it, never the same mask on every rank.

Why: a model's dropout (residual, embedding, hidden, PEFT's ``lora_dropout``) and its MoE
router noise (Mixtral-style jitter, PhiMoE's Gumbel sampling) draw a tensor shaped like the
activations they act on. Under CP those are ``(batch, seq_local, ...)``, and every rank of a
CP group holds the same generator state (``set_seed`` on every process, as the Trainer
does), so every rank would draw the same mask for different tokens: training that is
neither what one process computes nor independent noise, and says nothing.

How: while a guarded forward runs under CP, :class:`OneProcessDraws` (a
``TorchFunctionMode``) sees every torch call. A random one whose tensor has the sequence
axis (``(rows, seq_local, ...)``, or ``(rows * seq_local, ...)`` flattened batch-major) is
made on the full sequence's shape, with the same op and arguments, on the same generator,
and this rank keeps its own tokens (``token_index``, the layout's or the packed row's). The
generator therefore advances as in one process and every later draw matches too. A call
that gradient checkpointing replays (torch restores the generator for the recompute) draws
the same again. Any other random op on a sequence-shaped tensor, or one whose sequence
axis cannot be told, is refused by name on every rank (the shapes agree across ranks).

Exact on CPU: the full tensor is laid out as the op's own ``empty_like`` lays out the input,
so the same kernel draws the same numbers for every element, and the draw sliced is bitwise
one process's (tests/test_random_draws.py). On CUDA the full draw is the same kernel on the
same shape, so the masks are one process's too; a dropout's product is rounded once more
(the kernel multiplies by ``mask * scale`` in float32, this by the rounded ``scale``). Not run
on a GPU yet.

Cost: each sharded draw makes tensors of the full sequence's shape (dropout: a tensor of ones
and the kernel's noise, on CUDA also the op's output; each ``cp_size`` times the local
activation) for the duration of the call; docs/randomness.md gives the measured time and
memory.

Part of the transformers integration; uses no transformers API. Must not import the Trainer,
TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

import inspect
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hf_ring.patterns.validation import check_agreement
from hf_ring.hf.randomness.ops import (
    DRAWS_ONLY_IF, DROPOUTS, FILLS, LIKES, REFUSED, SIZED, WHAT_TO_DO, caller, dropout_flags, op_name,
)


def generator_digest(device: torch.device) -> int:
    """A 31-bit digest of the generators a draw on ``device`` reads: the CPU's, and the
    accelerator's for a tensor on one. Ranks whose digests agree draw the same numbers."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(getattr(torch, device.type).get_rng_state(device))
    digest = 0
    for state in states:
        digest = zlib.crc32(state.numpy().tobytes(), digest)
    return digest & 0x7FFFFFFF


@dataclass(frozen=True)
class _Placement:
    """Where a local tensor's tokens sit in the full sequence's tensor."""

    axis: int
    full_shape: tuple[int, ...]
    index: torch.Tensor  # int64 (n,) on the tensor's device: full-axis positions of the local ones


def check_generators_after(group: Any, device: torch.device) -> None:
    """After a forward whose draws ran some as they are (no sequence axis): every rank of the
    CP ``group`` must hold the same generators still. Collective over ``group``; raises the
    same ValueError on every rank where they differ (a draw whose size depended on a rank's
    own tokens: every draw after it was another rank's than one process's)."""
    check_agreement(
        group, [("generators", generator_digest(device))], device,
        "the random generators after this forward's draws",
        "a random draw whose size depends on this rank's own tokens (torch.rand(n) of a count of "
        "them, say) left the ranks' generators apart, so the draws after it were not one process's. "
        "Draw with a size every rank shares, or set that op's probability or noise to 0",
    )


def _full_like(x: torch.Tensor, where: _Placement) -> torch.Tensor:
    """An empty tensor of the full sequence's shape laid out in memory as ``empty_like(x)``
    lays out ``x``'s (its axes in the same stride order): some kernels draw in memory order,
    so a permuted tensor's draw is one process's only on the same layout."""
    if x.is_contiguous():
        return torch.empty(where.full_shape, dtype=x.dtype, device=x.device)
    strides = torch.empty_like(x).stride()  # what the op's own empty_like makes of x: dense or not
    order = sorted(range(x.dim()), key=lambda d: (-strides[d], d))
    physical = torch.empty([where.full_shape[d] for d in order], dtype=x.dtype, device=x.device)
    return physical.permute([order.index(d) for d in range(x.dim())])


@dataclass(eq=False)
class OneProcessDraws(TorchFunctionMode):
    """Random draws of one guarded forward under CP, made as one process makes them.

    Attributes:
        rows: the forward's batch size.
        seq_local: tokens per row on this rank.
        cp_size: the CP group's size.
        token_index: int64 ``(seq_local,)`` on the CPU: the full-row position of each of
            this rank's tokens (any layout, packed rows included).
        generator_digests: each CP rank's digest of its generators at the forward's start
            (cp_inputs.py gathers them in its header): draws need them all equal.
        device: the forward's inputs' device (where the generators are compared again).
        tp_size: the tensor-parallel size; beside TP a draw may be on a head-sharded
            tensor, which the full-sequence draw does not reproduce, so sharded draws are refused.
        full_len: tokens of the full row: ``seq_local * cp_size``, or a packed row's
            documents where they were placed by length (the ranks' rows then differ).
        refusal: why no sharded draw of this forward can match one process's (the caller's
            rows are laid out otherwise, :func:`~hf_ring.hf.randomness.refusals.draws_refused`), or None.
        unplaced: set when a draw without a sequence axis ran as it is: one whose size
            depends on a rank's own tokens would leave the ranks' generators apart, so the
            guard compares them after the forward (:func:`check_generators_after`).
        active: set while the mode is entered (the base model's forward, or a layer's
            recompute under gradient checkpointing); ``entered_by``: the id of the module
            whose hooks entered it (randomness/scope.py).
    """

    rows: int
    seq_local: int
    cp_size: int
    token_index: torch.Tensor
    generator_digests: tuple[int, ...]
    device: torch.device = torch.device("cpu")
    tp_size: int = 1
    full_len: int = 0
    refusal: Optional[str] = None
    unplaced: bool = False
    active: bool = False
    entered_by: Optional[int] = None
    _indices: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        super().__init__()
        if not self.full_len:
            self.full_len = self.seq_local * self.cp_size

    # ---------------------------------------------------------------- placement

    def _index(self, flat: bool, device: torch.device) -> torch.Tensor:
        key = (flat, device)
        if key not in self._indices:
            index = self.token_index
            if flat:  # row-major (rows * seq_local): row r's tokens follow row r-1's
                full = self.full_len
                index = (torch.arange(self.rows)[:, None] * full + index[None, :]).reshape(-1)
            self._indices[key] = index.to(device)
        return self._indices[key]

    def placement(self, shape: tuple[int, ...], device: torch.device, op: str) -> Optional[_Placement]:
        """Where a tensor of ``shape`` holds this rank's tokens; None: it has no sequence axis.

        Raises:
            NotImplementedError: the shape has the local length on an axis that is not
                the sequence's as hf_ring reads it, or the draw is beside tensor parallelism.
        """
        full = self.full_len
        found = None
        if len(shape) >= 2 and shape[0] == self.rows and shape[1] == self.seq_local:
            found = _Placement(1, (shape[0], full, *shape[2:]), self._index(False, device))
        elif len(shape) >= 1 and shape[0] == self.rows * self.seq_local:
            found = _Placement(0, (self.rows * full, *shape[1:]), self._index(True, device))
        elif self.seq_local in shape or self.rows * self.seq_local in shape:
            self._refuse(op, shape, "its sequence axis is not where hf_ring looks for it "
                         "(dim 1 after the batch, or dim 0 with the batch flattened in)")
        elif any(n > self.seq_local and n % self.seq_local == 0 for n in shape):
            # (rows, seq_local * hidden), (rows * seq_local * hidden,): the tokens folded into an axis.
            self._refuse(op, shape, f"an axis is a multiple of the local length ({self.seq_local}), so the "
                         "sequence may be folded into it (a reshape before the draw), which hf_ring cannot unfold")
        if found is not None and self.refusal is not None:
            self._refuse(op, shape, self.refusal)
        if found is not None and self.tp_size > 1:
            self._refuse(op, shape, f"beside tensor parallelism (tp_size={self.tp_size}) the tensor may "
                         "hold this rank's heads only, which a full-sequence draw does not reproduce")
        return found

    def _refuse(self, op: str, shape: tuple[int, ...], why: str) -> None:
        raise NotImplementedError(
            f"{op} draws random numbers for a sequence-sharded tensor {tuple(shape)} under context "
            f"parallelism (cp_size={self.cp_size}), called from {caller()}, and hf_ring cannot draw "
            f"it as one process would: {why}. {WHAT_TO_DO}"
        )

    def _check_generators(self) -> None:
        if len(set(self.generator_digests)) > 1:
            ranks = [r for r, d in enumerate(self.generator_digests) if d != self.generator_digests[0]]
            raise RuntimeError(
                f"the random generators of this context-parallel group differ (CP rank(s) {ranks} "
                "against rank 0) at the start of a forward that draws random numbers: hf_ring draws "
                "each dropout mask and router noise as one process would, which needs every rank of a "
                "CP group to hold the same generator state. Seed every process alike "
                "(transformers.set_seed(seed), as the Trainer does), and draw nothing on some ranks only"
            )

    # ---------------------------------------------------------------- the ops

    def _sharded(self, shape: tuple[int, ...], device: torch.device, func: Callable) -> Optional[_Placement]:
        """The placement of a draw about to be made of ``shape``, its generators checked; None
        (noted: the generators are compared after the forward) for a draw made as it is."""
        where = self.placement(shape, device, op_name(func))
        if where is not None and torch.compiler.is_compiling():
            # Inductor draws with its own generator, not torch's: the full-row draw would not be one
            # process's eager draw, and the ranks' agreement was never checked for it.
            self._refuse(op_name(func), shape, "inside torch.compile a compiled random op is not the eager "
                         "one, and hf_ring checks its full-sequence draws eagerly only; set the model's dropout "
                         "to 0 or train without torch_compile")
        if where is None:
            self.unplaced = True
        else:
            self._check_generators()
        return where

    def _take(self, full: torch.Tensor, where: _Placement) -> torch.Tensor:
        return full.index_select(where.axis, where.index)

    def _dropout(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        x, p, training, inplace = dropout_flags(func, args, kwargs)
        if not training or p == 0.0:
            return func(*args, **kwargs)  # draws nothing
        where = self._sharded(tuple(x.shape), x.device, func)
        if where is None:
            return func(*args, **kwargs)
        ones = _full_like(x, where).fill_(1)
        # The same call on ones: the mask scaled by 1 / (1 - p), drawn as one process draws it.
        # On CPU the in-place call draws as the other does and saves a full buffer; on CUDA the
        # two are other kernels, so the model's own form is kept.
        inplace_ones = inplace or x.device.type == "cpu"
        scale = func(ones, p, True, inplace_ones) if func is F.dropout else func(ones, p, True)
        local = self._take(scale, where)
        return x.mul_(local) if inplace else x * local

    def _fill(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        target = args[0]
        if func is torch.Tensor.bernoulli_ and isinstance(args[1] if len(args) > 1 else kwargs.get("p"), torch.Tensor):
            return self._checked(func, args, kwargs)  # per-token probabilities: not drawn in full
        where = self._sharded(tuple(target.shape), target.device, func)
        if where is None:
            return func(*args, **kwargs)
        full = _full_like(target, where)
        func(full, *args[1:], **kwargs)
        with torch.no_grad():
            target.copy_(self._take(full, where))
        return target

    def _like(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        x = args[0] if args else kwargs["input"]
        where = self._sharded(tuple(x.shape), x.device, func)
        if where is None:
            return func(*args, **kwargs)
        template = _full_like(x, where)
        rest = {k: v for k, v in kwargs.items() if k != "input"}
        return self._take(func(template, *args[1:], **rest), where)

    def _sized(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        size = kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args)
        shape = tuple(int(n) for n in size)
        device = torch.device(kwargs.get("device") or "cpu")
        where = self._sharded(shape, device, func)
        if where is None:
            return func(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k != "size"}
        return self._take(func(where.full_shape, **rest), where)

    def _checked(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        flag = DRAWS_ONLY_IF.get(func)
        if flag is not None:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            if not bound.arguments[flag] or float(bound.arguments.get("p", 1.0)) == 0.0:
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.unplaced = True
        tensors = [t for t in (*args, *kwargs.values(), *(out if isinstance(out, tuple) else (out,)))
                   if isinstance(t, torch.Tensor)]
        for t in tensors:
            if self.placement(tuple(t.shape), t.device, op_name(func)) is not None:
                self._refuse(op_name(func), tuple(t.shape), "hf_ring draws dropout, fills (uniform_, "
                             "exponential_, ...), rand_like / randn_like and rand / randn on the full "
                             "sequence, not this op")
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rule = _RULES.get(func)
        if rule is None:
            return func(*args, **(kwargs or {}))
        return rule(self, func, args, kwargs or {})


# One dict lookup per torch call: the mode sees every op of the forward.
_RULES: dict[Callable, Callable] = {
    **{f: OneProcessDraws._dropout for f in DROPOUTS},
    **{f: OneProcessDraws._fill for f in FILLS},
    **{f: OneProcessDraws._like for f in LIKES},
    **{f: OneProcessDraws._sized for f in SIZED},
    **{f: OneProcessDraws._checked for f in REFUSED},
}

