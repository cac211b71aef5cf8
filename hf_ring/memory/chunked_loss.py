"""The LM head and the cross-entropy computed together, chunk by chunk: no (tokens x vocabulary)
logits for the whole shard, forward or backward.

Why: once attention is split over a CP group, the logits are what limits the context. At
16K tokens per rank and a 128,256-token vocabulary they are 8.4 GB in float32, and as much
again for their gradient. Here the model runs up to its LM head (the head's input, the
final hidden states, is captured and the head itself is skipped); then
:class:`ChunkedLinearCrossEntropy` computes ``transform(hidden @ W.T + b)`` and its token
losses for ``chunk_tokens`` rows at a time, keeps only the float32 sum, and in backward
recomputes each chunk's logits to get its gradients. Peak memory for the loss: one chunk's
logits and their gradient. Only rows with a valid label (not -100) are computed: the others
contribute exactly 0 to the loss and to every gradient.

The model is still called through its own forward (and so through DDP, Accelerate's
autocast wrapper and hf_ring's ring guard): the head's ``forward`` is swapped for the
duration of the call with one that computes the chunked loss from its input and returns an
empty ``(..., 0)`` tensor, so whatever the forward does after the head costs nothing.
Computing it inside the head's call is what makes it work on sharded weights: there FSDP2
holds the head's unsharded weight (kept until its post-backward reduce-scatter) and
DeepSpeed ZeRO-3 the gathered one (released after the call, so the backward gathers it
again); the gradient goes to that parameter and the wrapper reduces it once, as any other. What a
model does to the head's output before returning it (Gemma's final softcapping, Cohere's
``logit_scale``, Granite's ``logits_scaling``) is read from its forward
(``hf_ring.patches.transformers.logit_transform``) and recomputed exactly in every chunk;
anything else is refused. Finding the head and recording its input: ``lm_head.py``.

The result is the same float32 token-loss sum as ``hf_ring.training.loss.token_loss_sum`` over the
full logits (the chunks' sums are added in another order: a few ulps), with the same
gradients for the hidden states, the head's weight (tied to the embeddings or not) and bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F

from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.memory.chunked_loss_compiled import compiled_chunked_loss, register_labels
from hf_ring.memory.lm_head import TURN_OFF, head_input_recorded, head_of
from hf_ring.memory.vocab_parallel import VocabParallelCrossEntropy, VocabShard, vocab_shard_of
from hf_ring.patches import deepspeed as deepspeed_patches
from hf_ring.patches import peft as peft_patches
from hf_ring.patches import transformers as transformers_patches

# A chunk's float32 logits take at most this much when chunk_tokens is not given (130 rows
# of a 128,256-token vocabulary: still a large matmul against a 4096-wide hidden state).
DEFAULT_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ChunkedLossConfig:
    """Whether and how to compute the loss without the full logits.

    Args:
        enabled: True / False; None (default) turns it on under context parallelism
            (``cp_size > 1``) or tensor parallelism (a vocabulary-sharded head), off otherwise.
        chunk_tokens: rows of logits per chunk; None chooses it so a chunk's float32
            logits take at most 64 MiB (``max(1, 2**24 // vocab_size)`` rows).
    """

    enabled: Optional[bool] = None
    chunk_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.enabled not in (None, True, False):
            raise ValueError(f"ChunkedLossConfig.enabled must be True, False or None (auto), not {self.enabled!r}")
        if self.chunk_tokens is not None and (not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1):
            raise ValueError(f"ChunkedLossConfig.chunk_tokens must be a positive int or None, not {self.chunk_tokens!r}")

    def active(self, cp_size: int, tp_size: int = 1) -> bool:
        """Whether the loss is computed by chunks: as set, or (None) under context parallelism
        or tensor parallelism (whose head would otherwise gather the whole logits on every rank)."""
        return self.enabled if self.enabled is not None else cp_size > 1 or tp_size > 1

    def rows_per_chunk(self, vocab_size: int) -> int:
        if self.chunk_tokens is not None:
            return self.chunk_tokens
        return max(1, DEFAULT_CHUNK_BYTES // (4 * vocab_size))


@dataclass(frozen=True)
class LogitTransform:
    """What the model applies to its LM head's output: ``kind`` is ``"identity"``,
    ``"softcap"`` (``tanh(x / value) * value``), ``"scale"`` (``x * value``) or ``"divide"``
    (``x / value``); the operations are those of the model's forward, in its order."""

    kind: str = "identity"
    value: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("identity", "softcap", "scale", "divide"):
            raise ValueError(f"unknown logit transform {self.kind!r}")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.kind == "softcap":
            return torch.tanh(logits / self.value) * self.value
        if self.kind == "scale":
            return logits * self.value
        if self.kind == "divide":
            return logits / self.value
        return logits

    @classmethod
    def of_model(cls, model: nn.Module, head_attr: str) -> "LogitTransform":
        """The transform ``model``'s forward applies after ``model.<head_attr>``.

        Raises:
            NotImplementedError: a forward whose logits hf_ring cannot recompute exactly.
        """
        try:
            kind = transformers_patches.logit_transform(model, head_attr)
        except NotImplementedError as exc:
            raise NotImplementedError(f"chunked loss: {exc}; {TURN_OFF}") from None
        config = model.config
        if kind == "final_logit_softcapping" and config.final_logit_softcapping is not None:
            return cls("softcap", float(config.final_logit_softcapping))
        if kind == "logit_scale":
            return cls("scale", float(model.logit_scale))
        if kind == "logits_scaling":
            return cls("divide", float(config.logits_scaling))
        return cls()


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, transform: LogitTransform, shard: Optional[VocabShard]) -> torch.Tensor:
    # The same operations as the model's head, its transform and token_loss_sum; on a
    # vocabulary slice (tensor parallelism), the cross-entropy reduced over the TP group.
    logits = transform(F.linear(hidden, weight, bias))
    if shard is not None:
        return VocabParallelCrossEntropy.apply(logits.float(), labels, shard)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum CE(transform(hidden @ weight.T + bias), labels)`` over valid rows, by chunks.

    ``apply(hidden, weight, bias, labels, chunk_tokens, transform, autocast_state, shard)``:
    hidden ``(rows, hidden_size)`` any float dtype; weight ``(vocab, hidden_size)``, or under
    tensor parallelism this rank's rows of it (``shard``: :class:`VocabShard`; else None);
    bias ``(vocab,)`` (or its rows) or None; labels int64 ``(rows,)`` with -100 ignored;
    returns a float32 scalar. With a shard, the hidden states' gradient is summed over the
    TP group (each rank's is its slice's part). Saves the
    valid rows only; backward recomputes each chunk's logits and differentiates them with
    autograd (the same operations as the forward), accumulating the weight's and bias's
    gradients in float32 (float64 for float64 weights).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, transform, autocast_state, shard=None):
        valid = labels.ne(IGNORE_INDEX).nonzero().squeeze(1)
        rows, valid_labels = hidden.index_select(0, valid), labels.index_select(0, valid)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with _autocast(hidden.device.type, autocast_state):
            for start in range(0, rows.shape[0], chunk_tokens):
                stop = start + chunk_tokens
                total = total + _chunk_loss(rows[start:stop], weight, bias, valid_labels[start:stop], transform,
                                            shard)
        ctx.save_for_backward(rows, valid_labels, valid, weight, bias)
        ctx.setup = (hidden.shape, chunk_tokens, transform, autocast_state, shard)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        rows, valid_labels, valid, weight, bias = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # ZeRO-3 released the head's weight after its forward: gathered again for the chunks.
        with deepspeed_patches.gathered_when_partitioned(weight, bias):
            return ChunkedLinearCrossEntropy._backward(ctx, grad_total, rows, valid_labels, valid, weight, bias,
                                                       (need_h, need_w, need_b))

    @staticmethod
    def _backward(ctx, grad_total, rows, valid_labels, valid, weight, bias, needs):
        hidden_shape, chunk_tokens, transform, autocast_state, shard = ctx.setup
        need_h, need_w, need_b = needs
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_rows = torch.zeros_like(rows) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for start in range(0, rows.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            with torch.enable_grad(), _autocast(rows.device.type, autocast_state):
                h = rows[start:stop].detach().requires_grad_(need_h)
                loss = _chunk_loss(h, w, b, valid_labels[start:stop], transform, shard)
            wanted = [t for t, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
            grads = iter(torch.autograd.grad(loss, wanted, grad_total))
            if need_h:
                grad_rows[start:stop] = next(grads)
            if need_w:
                grad_w += next(grads)
            if need_b:
                grad_b += next(grads)
        grad_hidden = None
        if need_h:
            if shard is not None:  # every TP rank's part of it, from its own vocabulary slice
                dist.all_reduce(grad_rows, op=dist.ReduceOp.SUM, group=shard.group)
            grad_hidden = grad_rows.new_zeros(hidden_shape).index_copy_(0, valid, grad_rows)
        return (grad_hidden, grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None, None, None, None, None, None)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(device_type: str, state: tuple[bool, torch.dtype]):
    enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def chunked_token_loss_sum(
    hidden: torch.Tensor,
    shift_labels: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    chunk_tokens: int,
    transform: LogitTransform = LogitTransform(),
    shard: Optional[VocabShard] = None,
) -> torch.Tensor:
    """``token_loss_sum(transform(F.linear(hidden, weight, bias)), shift_labels)`` without the
    full logits.

    Args:
        hidden: ``(..., hidden_size)``, the LM head's input, any float dtype.
        shift_labels: int64 ``(...)`` matching ``hidden.shape[:-1]``; ``-100`` is ignored.
        weight: ``(vocab, hidden_size)``, the head's weight (the embeddings when tied), or
            under tensor parallelism this rank's rows of it, ``(shard.rows, hidden_size)``.
        bias: ``(vocab,)`` (or its rows) or None.
        chunk_tokens: rows of logits computed at a time.
        transform: what the model applies to the head's output.
        shard: the vocabulary rows ``weight`` holds (:func:`vocab_parallel.vocab_shard_of`),
            or None for a whole weight. Collective over its TP group.

    Returns:
        A float32 scalar, differentiable in ``hidden``, ``weight`` and ``bias``.
    """
    if hidden.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} and shift_labels {tuple(shift_labels.shape)} disagree; "
            "shift_labels must have one entry per token (the collator's 'shift_labels')"
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise NotImplementedError(
            f"chunked loss: the LM head's weight is {tuple(weight.shape)}, not (vocab, {hidden.shape[-1]}) "
            f"(a sharded weight read outside its module's forward, e.g. a ZeRO-3 partition or an FSDP2 "
            f"shard: call it inside the head's forward, as model_token_loss_sum does); {TURN_OFF}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, not {chunk_tokens}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(hidden.device)
    if shard is not None and bool((labels >= shard.vocab).any()):  # one host sync; the full head's CE raises too
        raise ValueError(f"a label is {int(labels.max())}, outside the vocabulary of {shard.vocab} ids")
    state = _autocast_state(hidden.device.type)
    return ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, labels, chunk_tokens, transform, state, shard)


@dataclass(frozen=True, eq=False)
class _HeadLoss:
    """The loss computed inside the head's call, where FSDP2 / ZeRO-3 hold its whole weight
    (TP: this rank's rows). An object, not a closure: under torch.compile the head's call is
    traced and guarded on what it calls (lm_head.HeadRecorder).
    The labels reach a compiled head by handle only."""

    shift_labels: torch.Tensor
    chunk_tokens: int
    transform: LogitTransform
    labels_handle: torch.Tensor  # compiled, the op reads the labels by it (chunked_loss_compiled.py)

    def __call__(self, hidden: torch.Tensor, head_linear: nn.Linear) -> torch.Tensor:
        weight, bias = head_linear.weight, head_linear.bias
        shard = vocab_shard_of(weight)
        if shard is not None:
            weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
        if torch.compiler.is_compiling():  # one custom op whose body is ChunkedLinearCrossEntropy
            return compiled_chunked_loss(hidden, weight, bias, self.labels_handle, self.chunk_tokens,
                                         self.transform, shard)
        return chunked_token_loss_sum(hidden, self.shift_labels, weight, bias, chunk_tokens=self.chunk_tokens,
                                      transform=self.transform, shard=shard)


def model_token_loss_sum(
    model: Callable[..., Any],
    language_model: nn.Module,
    kwargs: dict[str, Any],
    shift_labels: torch.Tensor,
    config: ChunkedLossConfig,
) -> tuple[torch.Tensor, Any]:
    """Run ``model(**kwargs)`` and return this rank's token-loss sum, chunked, and the outputs
    (whose ``logits`` are empty: ``(..., 0)``).

    Args:
        model: what to call (the causal LM itself, or its DDP / Accelerate wrapper).
        language_model: the unwrapped causal LM inside ``model`` (e.g. ``LlamaForCausalLM``), or
            the PEFT model around it.
        kwargs: the forward's arguments, without labels.
        shift_labels: int64 ``(batch, local_seq)``, ``-100`` where nothing is learned.
        config: the chunking options.

    Raises:
        NotImplementedError: a model whose logits cannot be recomputed exactly by chunks
            (the message says how to turn chunking off).
    """
    if isinstance(language_model, torch._dynamo.eval_frame.OptimizedModule):
        # torch_compile=True beside FSDP2: the Trainer's model is the compiled FSDP2 module.
        language_model = language_model._orig_mod
    language_model = peft_patches.base_model(language_model)
    attr, head, linear = head_of(language_model)
    transform = LogitTransform.of_model(language_model, attr)
    if kwargs.get("logits_to_keep") not in (None, 0):
        raise ValueError(f"chunked loss: logits_to_keep={kwargs['logits_to_keep']!r}; the loss needs every token's logits")
    chunk_tokens = config.rows_per_chunk(linear.out_features)  # the weight's shape: a partition under ZeRO-3

    loss = _HeadLoss(shift_labels, chunk_tokens, transform, register_labels(shift_labels))
    with head_input_recorded(head, linear, loss) as recorded:
        outputs = model(**kwargs)
    if len(recorded) != 1:
        raise NotImplementedError(
            f"chunked loss: {type(language_model).__name__}.{attr} ran {len(recorded)} times in one forward, "
            f"not once; {TURN_OFF}"
        )
    token_sum = recorded[0]
    # The loss also reaches the forward's outputs, through their empty logits (which add exactly
    # 0 and pass back nothing). Under DDP with find_unused_parameters=True the outputs go through
    # DDP's sink, whose backward hands every output the loss does not use an undefined gradient
    # (LLaVA's image_outputs: the vision tower's last layer, whose output no feature layer reads),
    # which the reducer takes as those parameters' turn. A loss that bypassed the sink left them
    # pending: "Expected to have finished reduction in the prior iteration" at the next step.
    logits = getattr(outputs, "logits", None)
    if logits is not None and logits.requires_grad:
        token_sum = token_sum + logits.sum().to(token_sum.dtype)  # float32 whatever the model's dtype
    return token_sum, outputs
