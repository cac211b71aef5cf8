"""The chunked LM-head loss under ``torch.compile``: one custom op, its body the eager code.

Why: compiled, the LM head's call is traced (the chunked loss runs inside it,
``lm_head.py``), and :class:`~hf_ring.memory.chunked_loss.ChunkedLinearCrossEntropy`
cannot be: it picks the rows with a label (``nonzero``, a shape that depends on the data)
and loops over them by chunks in Python, so dynamo broke the graph there and compiled the
rest of the head's call again at every step. Here it is one opaque call,
``torch.ops.hf_ring.chunked_linear_cross_entropy``, whose body runs that same autograd
Function eagerly (:func:`hf_ring.patterns.compiled.run_taped`) and whose backward replays
its recorded graph (``hf_ring::tape_backward``), as the attention's op does
(``hf_ring/hf/compiled.py``): the loss and its gradients are the eager code's, operation
for operation, and only the valid rows are kept for the backward, as uncompiled.

Not composed: a vocabulary-sharded head (tensor parallelism), refused by name.

Must not import the Trainer, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Optional

import torch

from hf_ring.patterns.compiled import run_taped, tape_backward


# Each forward's labels by handle. They never enter the traced graph: a tensor read from the
# head's forward (an attribute of a module) keeps its first shape in dynamo's guards, and
# every new sequence length recompiled the graph; the op's body reads them by handle.
_LABELS: dict[int, torch.Tensor] = {}
_IDS = itertools.count(1)
# How many times the op's body ran: tests read it to tell a compiled head from one run eagerly.
OP_CALLS: collections.Counter = collections.Counter()


def register_labels(labels: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 handle under which the op finds ``labels`` (int64 ``(...)``, -100 ignored)
    while the handle lives (called outside any compiled region, once per forward)."""
    handle_id = next(_IDS)
    _LABELS[handle_id] = labels
    handle = torch.tensor(handle_id, dtype=torch.int64)
    weakref.finalize(handle, _LABELS.pop, handle_id, None)
    return handle


@torch.library.custom_op("hf_ring::chunked_linear_cross_entropy", mutates_args=())
def chunked_linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels_handle: torch.Tensor,
    chunk_tokens: int,
    transform_kind: str,
    transform_value: float,
    autocast_enabled: bool,
    autocast_dtype: torch.dtype,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ChunkedLinearCrossEntropy.apply`` on ``hidden``'s rows and their labels, run eagerly.

    Args:
        hidden: ``(..., hidden_size)``; weight ``(vocab, hidden_size)``; bias ``(vocab,)`` or None.
        labels_handle: the forward's labels (:func:`register_labels`), one per row of ``hidden``.
        chunk_tokens: rows of logits per chunk.
        transform_kind, transform_value: the model's :class:`LogitTransform`.
        autocast_enabled, autocast_dtype: the autocast state of the traced call (the op's
            body runs outside any autocast region; the chunks enter this one).
        record: keep the autograd graph for the backward.

    Returns:
        the float32 token-loss sum (0-d) and the tape id (0-d int64).
    """
    # Deferred import: chunked_loss.py imports this module to route compiled calls here.
    from hf_ring.memory.chunked_loss import ChunkedLinearCrossEntropy, LogitTransform

    OP_CALLS["chunked_linear_cross_entropy"] += 1
    labels = _LABELS.get(int(labels_handle))
    if labels is None:
        raise RuntimeError("a compiled chunked loss ran without its forward's labels (the call that registered "
                           "them has ended); call the model through model_token_loss_sum")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and shift_labels {tuple(labels.shape)} disagree; "
                         "shift_labels must have one entry per token (the collator's 'shift_labels')")
    labels = labels.reshape(-1).to(hidden.device)
    transform = LogitTransform(transform_kind, transform_value)

    def run(h, w, b):
        return (ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), w, b, labels, chunk_tokens, transform,
                                                (autocast_enabled, autocast_dtype), None),)

    (total,), tape = run_taped(run, (hidden, weight, bias), record)
    return total, tape


@chunked_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels_handle, chunk_tokens, transform_kind, transform_value, autocast_enabled,
      autocast_dtype, record):
    return hidden.new_empty((), dtype=torch.float32), torch.empty((), dtype=torch.int64)


def _setup(ctx, inputs, output) -> None:
    hidden, weight, bias = inputs[:3]
    ctx.save_for_backward(output[1], hidden, weight, bias)


def _backward(ctx, dtotal, _dtape):
    tape, hidden, weight, bias = ctx.saved_tensors
    grads = tape_backward(tape, [dtotal], [hidden, weight, bias])
    return grads[0], grads[1], grads[2] if bias is not None else None, *(None,) * 7


chunked_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def compiled_chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          labels_handle: torch.Tensor, chunk_tokens: int, transform, shard) -> torch.Tensor:
    """What the chunked loss runs inside a traced LM head: the op (``hidden`` ``(..., hidden_size)``,
    ``labels_handle`` from :func:`register_labels`)."""
    if shard is not None:
        raise NotImplementedError(
            "the chunked loss on a vocabulary-sharded LM head (tensor parallelism) is not composed with "
            "torch.compile; train the tensor-parallel model uncompiled, or turn the chunked loss off "
            "(RingTrainer(chunked_loss=False), --chunked_loss off in the example)")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise NotImplementedError(f"chunked loss: the LM head's weight is {tuple(weight.shape)}, not "
                                  f"(vocab, {hidden.shape[-1]})")
    record = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    device = hidden.device.type
    enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    total, _ = torch.ops.hf_ring.chunked_linear_cross_entropy(
        hidden, weight, bias, labels_handle, chunk_tokens, transform.kind, float(transform.value), enabled, dtype,
        record)
    return total


__all__ = ["OP_CALLS", "chunked_linear_cross_entropy_op", "compiled_chunked_loss", "register_labels"]
