"""The LM head under the chunked loss: which module it is, and its forward replaced by a
recorder while the model runs (``hf_ring.memory.chunked_loss`` computes the logits chunk by
chunk from the recorded input and the head's weight, never running the head).

Must not import the Trainer, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn

from hf_ring.patches import peft as peft_patches
from hf_ring.patches import torch as torch_patches

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
    if type(linear).forward is not nn.Linear.forward or "forward" in vars(linear):
        raise NotImplementedError(
            f"chunked loss: {where} is a {type(linear).__name__} with a forward of its own, not a plain nn.Linear "
            f"(a LoRA adapter on the LM head is one: leave lm_head out of target_modules); {TURN_OFF}"
        )
    # Hooks would see the recorder's empty output, and their result would be dropped.
    if torch_patches.has_forward_hooks(head) or torch_patches.has_forward_hooks(linear):
        raise NotImplementedError(
            f"chunked loss: {where} has forward hooks, whose effect on the logits the "
            f"chunked loss cannot reproduce (it never runs the head); remove them, or {TURN_OFF}"
        )
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()
    if isinstance(linear.weight, DTensor) or isinstance(linear.weight.data, DTensor):
        raise NotImplementedError(f"chunked loss: the LM head's weight is a DTensor (FSDP2 / tensor parallel); {TURN_OFF}")
    return attr, head, linear


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


@contextlib.contextmanager
def head_input_recorded(head: nn.Module, linear: nn.Linear) -> Iterator[list[torch.Tensor]]:
    """While open, ``head(x)`` records ``x`` and returns an empty ``x.shape[:-1] + (0,)``
    (:class:`SkippedHead`), through which the forward's outputs still reach the weight and
    bias of ``linear`` (the head, or the module a PEFT wrapper of it runs) in the autograd
    graph. DDP with ``find_unused_parameters=True`` (the Trainer's default without gradient
    checkpointing) would otherwise take the weight for unused, mark it ready after the
    forward, and fail when the chunks' backward reaches it."""
    recorded: list[torch.Tensor] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        recorded.append(x)
        return SkippedHead.apply(x, linear.weight, linear.bias)

    head.forward = record
    try:
        yield recorded
    finally:
        del head.forward
