"""PyTorch's pipeline schedules over hf_ring's stages, with the token-sum loss on the last stage.

Why it is PyTorch's engine and not one of our own: the schedules
(``torch.distributed.pipelining``: GPipe, 1F1B, interleaved 1F1B, zero-bubble) order the
forwards, backwards and point-to-point sends of every micro-batch so that nothing deadlocks
and the bubble is what its paper says; hf_ring only gives them stages and a loss.

The loss of a micro-batch on the last stage is its share of the step's token mean,
``sum of its token losses on this CP shard / the step's valid tokens over dp x cp and every
micro-batch`` (``hf_ring.training.loss``). Those shares add up, over micro-batches and the
stage's dp x cp ranks, to one process's loss, and their gradients to its gradients, so the
schedule is built with ``scale_grads=False``: its default divides every gradient by the
number of micro-batches, which is right only for a loss averaged per micro-batch. With the
chunked loss (``chunked_loss``) the last stage returns that token-loss sum itself, computed
inside its LM head's call without the logits (``stages.StageModule``), and every stage is
handed the micro-batch's ``shift_labels`` among its keyword arguments (as ``position_ids``):
the loss function only divides by the step's tokens.

Every rank of a stage's CP group runs the same schedule on its shard of the same
micro-batches, so the ring's collectives inside a stage meet in the same order on every
rank; the sends between stages go over the ``pp`` group of the mesh (ranks of one dp, cp and
tp coordinate). Stages are built with their input and output shapes given (PyTorch's
static mode: no forward is run to infer them), once per shape of micro-batch.

Must not import accelerate, TRL, or hf_ring's training layer but its loss arithmetic.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from hf_ring.memory.chunked_loss import ChunkedLossConfig
from hf_ring.patterns.state import ContextParallelState
from hf_ring.pipeline.split import stage_layer_ranges, stages_of_rank
from hf_ring.pipeline.stages import StageModule, build_stage_modules
from hf_ring.training.loss import loss_share, token_loss_sum

# PyTorch's schedule names hf_ring runs; with their stages per rank (V-shaped: two a rank).
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
_V_SHAPED = ("ZBVZeroBubble",)
# Evaluation (forward only, ``schedule.eval``): PyTorch's zero-bubble schedules run their split
# backward actions in eval too (torch 2.13: "can't steal_bwd_input"), so the looped one evaluates
# with the interleaved schedule over the same stages; the V-shaped one has no forward-only peer.
_EVAL_SCHEDULE = {"InterleavedZeroBubble": "Interleaved1F1B"}


def schedule_class(name: str) -> type:
    """PyTorch's class for the schedule ``name`` (one of :data:`SCHEDULES`, case as written)."""
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} is not one of the schedules hf_ring runs: {', '.join(SCHEDULES)} "
                         "(PyTorch's names, torch.distributed.pipelining)")
    return get_schedule_class(name)


def stages_per_rank_of(name: str, requested: Optional[int] = None) -> int:
    """How many stages each rank holds under ``name``: 1 for a single-stage schedule, else
    ``requested`` (default 2; the V-shaped ones exactly 2)."""
    if issubclass(schedule_class(name), PipelineScheduleSingle):
        if requested not in (None, 1):
            raise ValueError(f"pp_schedule={name!r} runs one stage per rank, not {requested}; use an interleaved "
                             "schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) for several")
        return 1
    value = 2 if requested is None else requested
    if isinstance(value, bool) or not isinstance(value, int) or value < 2 or (name in _V_SHAPED and value != 2):
        raise ValueError(f"pp_schedule={name!r} needs {'exactly 2' if name in _V_SHAPED else 'at least 2'} stages "
                         f"per rank, got {requested!r}")
    return value


class TokenShareLoss:
    """The schedule's ``loss_fn``: a micro-batch's token-loss sum on this CP shard over the
    step's valid tokens (:attr:`global_count`, set before every step).

    ``output``: the last stage's logits ``(rows, local_seq, vocab)``, or with ``summed`` its
    float32 scalar token-loss sum (the chunked loss, computed by the stage); ``shift_labels``
    int64 ``(rows, local_seq)``. Returns a float32 scalar."""

    def __init__(self, summed: bool = False) -> None:
        self.summed = summed
        self.global_count: Optional[torch.Tensor] = None

    def __call__(self, output: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        if self.global_count is None:
            raise RuntimeError("the pipeline's loss has no token count: call PipelineRunner.step")
        token_sum = output if self.summed else token_loss_sum(output, shift_labels)
        return loss_share(token_sum, self.global_count)


class PipelineRunner:
    """This rank's stages of ``model`` and the schedule that trains them.

    Args:
        model: a causal LM (``attn_implementation="ring_flash"`` under CP), pruned here to
            this rank's stages.
        state: the context-parallel state built with ``pp_size`` (its mesh's ``pp`` axis).
        schedule: one of :data:`SCHEDULES`.
        n_microbatches: micro-batches per step.
        stages_per_rank: interleaved schedules: stages on each rank (default 2).
        pp_layers: decoder layers per stage, in stage order (default: an even split).
        chunked_loss: compute the last stage's loss by chunks, without its logits
            (``hf_ring.memory.chunked_loss``), as configured (its ``enabled`` True or None:
            the caller decided it is on); None: from the logits.
    """

    def __init__(self, model: nn.Module, state: ContextParallelState, schedule: str = "1F1B",
                 n_microbatches: int = 2, stages_per_rank: Optional[int] = None,
                 pp_layers: Optional[Sequence[int]] = None, chunked_loss: Optional[ChunkedLossConfig] = None):
        self.schedule_name = schedule
        self.v_per_rank = stages_per_rank_of(schedule, stages_per_rank)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"pp_microbatches must be a positive int, got {n_microbatches!r}")
        self.n_microbatches = n_microbatches
        self.state = state
        self.pp_size, self.pp_rank = state.mesh.size("pp"), state.mesh.rank("pp")
        self.num_stages = self.pp_size * self.v_per_rank
        self.ranges = stage_layer_ranges(len(model.base_model.layers), self.num_stages, pp_layers)
        self.stage_ids = stages_of_rank(self.pp_rank, self.pp_size, self.v_per_rank, schedule in _V_SHAPED)
        if chunked_loss is not None and chunked_loss.enabled is False:
            raise ValueError("chunked_loss=ChunkedLossConfig(enabled=False) asks for no chunking: pass None for the "
                             "loss from the last stage's logits")
        self.chunked_loss = chunked_loss
        self.stages: dict[int, StageModule] = build_stage_modules(model, self.stage_ids, self.ranges, chunked_loss)
        self.loss = TokenShareLoss(summed=chunked_loss is not None)
        self._schedules: dict[tuple, Any] = {}

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stages

    def _schedule_for(self, rows: int, local_len: int, hidden: int, vocab: int, dtype: torch.dtype,
                      device: torch.device, training: bool = True) -> Any:
        """The schedule for micro-batches of ``rows x local_len`` tokens (built on first use);
        a forward-only one (``training=False``: its own stages, run by ``schedule.eval``) apart,
        so that evaluation never switches a training schedule's buffers."""
        key = (rows, local_len, dtype, device, training)
        if key not in self._schedules:
            pipeline_stages = []
            for s, module in self.stages.items():
                hidden_states = torch.empty(rows, local_len, hidden, dtype=dtype, device="meta", requires_grad=True)
                inputs = torch.empty(rows, local_len, dtype=torch.long, device="meta") if s == 0 else hidden_states
                outputs = hidden_states
                if module.is_last:  # the logits, or the chunked loss's float32 token-loss sum
                    outputs = torch.empty((), dtype=torch.float32, device="meta") if self.chunked_loss is not None \
                        else torch.empty(rows, local_len, vocab, dtype=dtype, device="meta")
                pipeline_stages.append(PipelineStage(module, s, self.num_stages, device, input_args=inputs,
                                                     output_args=outputs, group=self.state.mesh.group("pp")))
            cls = schedule_class(self.schedule_name if training else _EVAL_SCHEDULE.get(self.schedule_name,
                                                                                         self.schedule_name))
            first = pipeline_stages[0] if issubclass(cls, PipelineScheduleSingle) else pipeline_stages
            self._schedules[key] = cls(first, n_microbatches=self.n_microbatches, loss_fn=self.loss,
                                       scale_grads=False)
        return self._schedules[key]

    def _run(self, batch: dict[str, Any], global_count: torch.Tensor, training: bool) -> Optional[torch.Tensor]:
        ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["shift_labels"]
        if ids.shape[0] % self.n_microbatches:
            raise ValueError(f"a batch of {ids.shape[0]} rows does not split into pp_microbatches="
                             f"{self.n_microbatches} micro-batches of equal size")
        any_module = next(iter(self.stages.values())).lm
        param = next(any_module.parameters())
        head = getattr(any_module, "lm_head", None)
        vocab = getattr(head, "out_features", None) or any_module.config.vocab_size
        built = len(self._schedules)
        schedule = self._schedule_for(ids.shape[0] // self.n_microbatches, ids.shape[1], any_module.config.hidden_size,
                                      vocab, param.dtype, param.device, training)
        # A schedule's first step ends its set-up by setting every FSDP2 module's gradients to None
        # (torch 2.13: _post_metadata_inference_cleanup, static shapes too): a schedule built for a new
        # micro-batch shape in the middle of an accumulated step would drop the step's gradients so far.
        # They are kept here and added back after the step (no copy: the cleanup only unsets .grad); a
        # release that leaves them lets FSDP2 accumulate into the same objects, which are then left alone.
        kept = {p: p.grad for stage in self.stages.values() for p in stage.parameters()
                if p.grad is not None and isinstance(p.grad, DTensor)} if len(self._schedules) > built else {}
        self.loss.global_count = global_count
        kwargs = {"position_ids": positions}
        if batch.get("doc_bounds") is not None:
            kwargs["doc_bounds"] = batch["doc_bounds"]
        if self.chunked_loss is not None:  # the last stage's input; PyTorch hands every stage the same kwargs
            kwargs["shift_labels"] = labels
        losses: list = []
        args = (ids,) if self.has_first else ()
        target = labels if self.has_last else None
        try:
            run = schedule.step if training else schedule.eval
            run(*args, target=target, losses=losses if self.has_last else None, return_outputs=False, **kwargs)
        finally:
            self.loss.global_count = None
            for p, grad in kept.items():  # unset: put back; a new gradient: add; the same object: left as it is
                if p.grad is None:
                    p.grad = grad
                elif p.grad is not grad:
                    p.grad.add_(grad)
        return torch.stack(losses).sum() if self.has_last else None

    def step(self, batch: dict[str, Any], global_count: torch.Tensor) -> Optional[torch.Tensor]:
        """Run one step's forwards and backwards over ``batch`` (this rank's CP shard: ``input_ids``,
        ``position_ids``, ``shift_labels`` and for packed rows ``doc_bounds``, micro-batches along
        dim 0). ``global_count``: the step's valid tokens over the stage's dp x cp ranks.

        Returns the sum of the micro-batches' loss shares on a rank holding the last stage
        (this CP shard's part of the step's loss), else None. Gradients accumulate in the
        model's parameters (not reduced over dp x cp: the caller's wrapper or loop does; under
        the plugin's ``pp_fsdp`` FSDP2's reduce-scatter has summed them)."""
        return self._run(batch, global_count, training=True)

    def evaluate(self, batch: dict[str, Any]) -> Optional[torch.Tensor]:
        """Forwards only (PyTorch's ``schedule.eval``) over ``batch``, as :meth:`step` takes it:
        on a rank holding the last stage the float32 sum of this CP shard's token losses over
        every micro-batch, else None. Run it under ``torch.no_grad()``. Not under ``ZBVZeroBubble``
        (PyTorch's runs its backward actions in eval too: evaluate with another schedule)."""
        if self.schedule_name in _V_SHAPED:
            raise NotImplementedError(f"evaluation under pp_schedule={self.schedule_name!r} is not composed (PyTorch's "
                                      "schedule runs its backward actions in eval too); evaluate with another schedule")
        return self._run(batch, torch.ones((), dtype=torch.float32), training=False)


__all__ = ["SCHEDULES", "PipelineRunner", "TokenShareLoss", "schedule_class", "stages_per_rank_of"]
