"""The LM head under the chunked loss: which module it is, and its forward replaced by a
recorder while the model runs (``hf_ring.memory.chunked_loss`` computes the logits chunk by
chunk from the head's input and weight inside the head's call, never running the head: under
FSDP2 and ZeRO-3 the weight is whole only there).

Must not import the Trainer, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from hf_ring.patches import peft as peft_patches
from hf_ring.patches import torch as torch_patches
from hf_ring.patches import transformers as transformers_patches

TURN_OFF = "turn the chunked loss off (RingTrainer(chunked_loss=False), or --chunked_loss off in the example)"


def head_of(model: nn.Module) -> tuple[str, nn.Module, nn.Linear]:
    """``(attribute, head, linear)``: the LM head among ``model``'s children, and the plain
    ``nn.Linear`` whose weight computes its logits (the head itself, or under PEFT's
    ``modules_to_save`` the copy its wrapper runs now)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    attr = next((name for name, child in model.named_children() if child is head), None) if head is not None else None
    if attr is None:
        raise NotImplementedError(
            f"chunked loss: {type(model).__name__} has no LM head among its direct children "
            f"(get_output_embeddings()); {TURN_OFF}"
        )
    linear = peft_patches.module_run_by(head) or head
    where = f"{type(model).__name__}.{attr}"
    if linear is not head:
        where += f" (PEFT's {type(head).__name__} runs a {type(linear).__name__})"
    # transformers' tensor parallelism installs a forward that gathers the vocabulary-sharded
    # logits; the chunked loss runs in its place on this rank's rows (vocab_parallel.py).
    own_forward = "forward" in vars(linear) and not transformers_patches.tensor_parallel_forward(linear)
    if type(linear).forward is not nn.Linear.forward or own_forward:
        raise NotImplementedError(
            f"chunked loss: {where} is a {type(linear).__name__} with a forward of its own, not a plain nn.Linear "
            f"(a LoRA adapter on the LM head is one: leave lm_head out of target_modules); {TURN_OFF}"
        )
    # Hooks would see the recorder's empty output, and their result would be dropped. FSDP2's and
    # ZeRO-3's own hooks only gather and release the weight, which the loss uses inside the call.
    if torch_patches.foreign_forward_hooks(head) or torch_patches.foreign_forward_hooks(linear):
        raise NotImplementedError(
            f"chunked loss: {where} has forward hooks, whose effect on the logits the "
            f"chunked loss cannot reproduce (it never runs the head); remove them, or {TURN_OFF}"
        )
    _check_fsdp2_unit(where, head, linear)
    return attr, head, linear


def _check_fsdp2_unit(where: str, head: nn.Module, linear: nn.Module) -> None:
    """Under FSDP2 the loss's backward reuses the unsharded weight it ran with: right when the
    head's unit keeps it unsharded until its post-backward reduce-scatter (Accelerate's tail
    unit ``[final norm, lm_head]``, ``reshard_after_forward=False``; or the head inside the
    root's unit, never resharded after forward); refused for a unit that reshards after its
    forward (the root is checked at its first forward, when FSDP2 has settled it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    unit = next((m for m in (linear, head) if isinstance(m, FSDPModule)), None)
    if unit is not None and torch_patches.fsdp2_reshards_after_forward(unit):
        raise NotImplementedError(
            f"chunked loss: {where} is an FSDP2 unit that reshards its weight after its forward, while the "
            f"chunked loss needs it whole in backward; wrap it with reshard_after_forward=False (as Accelerate's "
            f"FSDP2 does), or {TURN_OFF}"
        )


class SkippedHead(torch.autograd.Function):
    """The skipped head's output: an empty ``x.shape[:-1] + (0,)`` tensor of ``x``'s dtype, in
    the autograd graph of ``x`` and of the head's weight and bias (DDP's search for unused
    parameters starts from the forward's outputs and must reach them), passing back no
    gradient at all (undefined), so that a loss reaching it computes and allocates nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return x.new_empty(x.shape[:-1] + (0,))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        return None, None, None


# Where a head keeps its recorder between calls (its instance __dict__, not a submodule).
_RECORDER = "_hf_ring_head_recorder"


class HeadRecorder:
    """The head's forward while the loss is recorded: one object per head, kept across calls
    and given each call's loss, linear and list. Under ``torch.compile`` the head's forward is
    traced, and the compiled graph is guarded on that forward's identity: a new function each
    call (a closure) recompiled the graph after the head at every step, and after 8 steps
    dynamo gave up compiling it. ``loss`` must itself be an object whose class defines
    ``__call__`` (a closure would be new each call again)."""

    def __init__(self) -> None:
        self.loss: Optional[Callable[[torch.Tensor, nn.Linear], torch.Tensor]] = None
        self.linear: Optional[nn.Linear] = None
        self.recorded: Optional[list[torch.Tensor]] = None

    def open(self, loss, linear, recorded) -> None:
        self.loss, self.linear, self.recorded = loss, linear, recorded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.recorded is None:
            raise RuntimeError("the chunked loss's recorder of the LM head ran outside model_token_loss_sum")
        self.recorded.append(self.loss(x, self.linear))
        return SkippedHead.apply(x, self.linear.weight, self.linear.bias)


@contextlib.contextmanager
def head_input_recorded(
    head: nn.Module, linear: nn.Linear, loss: Callable[[torch.Tensor, nn.Linear], torch.Tensor]
) -> Iterator[list[torch.Tensor]]:
    """While open, ``head(x)`` records ``loss(x, linear)`` and returns an empty
    ``x.shape[:-1] + (0,)`` (:class:`SkippedHead`). The loss is computed inside the head's
    call, where the sharding wrappers have gathered its weight (FSDP2's unsharded parameter,
    ZeRO-3's gathered one: ``linear.weight`` is whole there, a DTensor or an empty partition
    outside). The output reaches the forward's outputs still reach the weight and
    bias of ``linear`` (the head, or the module a PEFT wrapper of it runs) in the autograd
    graph. DDP with ``find_unused_parameters=True`` (the Trainer's default without gradient
    checkpointing) would otherwise take the weight for unused, mark it ready after the
    forward, and fail when the chunks' backward reaches it."""
    recorder = vars(head).get(_RECORDER)
    if recorder is None:
        recorder = vars(head)[_RECORDER] = HeadRecorder()
    recorded: list[torch.Tensor] = []
    installed = vars(head).get("forward")  # tensor parallelism's, put back after
    recorder.open(loss, linear, recorded)
    head.forward = recorder
    try:
        yield recorded
    finally:
        recorder.open(None, None, None)
        if installed is not None:
            head.forward = installed
        else:
            del head.forward
