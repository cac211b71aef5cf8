"""TRL's fused-LM-head forward on whole sequences, run as a ring over the CP group.

TRL's preference trainers call ``model(input_ids, attention_mask, labels=...,
fused_lm_head=True)`` on whole, right-padded rows and get per-token fields back
(``log_probs``, ``entropy``, ``is_top1``, ...; shape ``(batch, seq - 1)``), which they sum
per sequence into log-probabilities and turn into the loss and every metric. A sequence's
log-probability is a sum over *all* of its tokens, which under context parallelism live
on ``cp_size`` ranks, and the loss is a nonlinear function of it: a per-rank loss would
be wrong, not just scaled.

:class:`RingFusedForward` stands in for the model in that call: it pads the rows to what
the layout needs, shifts the labels on the full row, keeps this rank's shard (with global
position ids), runs the model's fused head on it (the ring attends over the whole CP
group), then all-gathers every per-token field back into whole rows. TRL's own loss and
metric code then runs, unchanged, on exactly the tensors it sees without CP, and every
rank of a CP group computes the same loss.

``packed=True`` (the rollout trainers' ``padding_free``) runs the rows as one packed row of
documents instead (:mod:`hf_ring.sharding.row_packing`): each document is sharded on its
own, ``ring_flash`` reads their boundaries, and the fields come back in the rows' layout.

Gradients: the gathered ``log_probs`` is differentiable
(:func:`hf_ring.distributed.rows.gather_rows`). Its backward is a reduce-scatter: each rank
receives the CP group's summed gradient of the full row at its own shard's positions. Every
rank's parameters then receive ``cp_size`` times their share, which DDP's average over all
``dp_size * cp_size`` processes turns into exactly the gradient of a run without CP, and
the loss each rank returns (and the Trainer logs) is the true per-batch loss.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from hf_ring.distributed.rows import gather_rows
from hf_ring.hf.guard import per_token_labels
from hf_ring.hf.randomness.refusals import draws_refused
from hf_ring.patches import trl as trl_patches
from hf_ring.patterns.state import ContextParallelState
from hf_ring.sharding import required_multiple, shard_packed, shard_sequence
from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.sharding.row_packing import pack_rows, unpack_field

# What TRL's preference trainers pass; anything else (pixel values, router logits) is refused under CP.
_ACCEPTED = frozenset({"input_ids", "attention_mask", "labels", "fused_lm_head", "use_cache"})
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


# Why a forward's random draws (dropout, LoRA dropout, router noise) cannot be TRL's own.
_PADDED = ("TRL's rows of {seq} tokens run padded to {padded} under context parallelism (a multiple of what the "
           "layout needs), and one process's dropout mask of a row depends on the batch's padded length")
_PACKED = ("padding_free runs TRL's rows as one packed row under context parallelism, where TRL's one process "
           "runs them as padded rows: the dropout masks of their tokens differ")


def _unless(aligned: bool, reason: str):
    return contextlib.nullcontext() if aligned else draws_refused(reason)


def _whole_rows(out: Any, to_rows: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """TRL's output of whole rows from the model's output on this rank's shard: ``to_rows``
    applied to each per-token field that is there, ``loss`` None."""
    fields = {name: to_rows(getattr(out, name)) for name in _PER_TOKEN_FIELDS if getattr(out, name, None) is not None}
    return trl_patches.fused_output_class()(loss=None, **fields)


def _check_right_padded(attention_mask: torch.Tensor) -> None:
    lengths = attention_mask.long().sum(dim=1, keepdim=True)
    expected = torch.arange(attention_mask.shape[1], device=attention_mask.device) < lengths
    if not torch.equal(attention_mask.bool(), expected):
        raise ValueError(
            "under context parallelism the rows must be right-padded (attention_mask ones, then zeros); "
            "TRL's DataCollatorForPreference pads on the right: keep it"
        )


class RingFusedForward:
    """Calls ``model`` like TRL does, but on this rank's shard of every row (see the module docstring).

    Args:
        model: the (possibly DDP-wrapped) causal LM that TRL gave a fused LM head
            (``trl.trainer.utils.add_fused_lm_head``), loaded with ``attn_implementation="ring_flash"``.
        state: the context-parallel state (group, rank, size, layout).
        pad_token_id: id written into the padding this wrapper adds (never attended to, never learned).
        packed: run the rows as one packed row of documents (:mod:`hf_ring.sharding.row_packing`),
            each padded to ``2 * cp_size`` only, instead of every row to the longest; the fields
            come back in the same ``(batch, seq - 1)`` layout.
    """

    def __init__(self, model: Any, state: ContextParallelState, pad_token_id: int = 0, packed: bool = False):
        self.model = model
        self.state = state
        self.pad_token_id = pad_token_id
        self.packed = packed

    def __call__(
        self,
        *args: Any,
        input_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        fused_lm_head: bool = False,
        **kwargs: Any,
    ) -> Any:
        """``input_ids`` and ``labels``: int64 ``(batch, seq)``, labels ``-100`` where nothing is
        scored; ``attention_mask`` ``(batch, seq)`` right padding. Returns TRL's
        ``FusedCausalLMOutput`` with per-token fields ``(batch, seq - 1)``, ``loss`` None."""
        unknown = sorted(set(kwargs) - _ACCEPTED)
        if args or unknown or not fused_lm_head or input_ids is None or labels is None:
            raise NotImplementedError(
                "under context parallelism hf_ring.trl runs the model only as TRL's preference loss does: "
                "model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True); got "
                f"{len(args)} positional arguments, fused_lm_head={fused_lm_head}, other arguments {unknown} "
                "(multimodal inputs and MoE router losses are not supported under CP)"
            )
        if attention_mask is not None:
            _check_right_padded(attention_mask)
        if self.packed:
            return self._packed_forward(input_ids, labels, attention_mask)
        state = self.state
        batch, seq = input_ids.shape
        multiple = required_multiple(state.cp_size, state.layout)
        padded = -(-seq // multiple) * multiple
        ids = input_ids.new_full((batch, padded), self.pad_token_id)
        ids[:, :seq] = input_ids
        # Labels shifted on the whole row: position t scores token t + 1, which may sit on another rank.
        shift_labels = labels.new_full((batch, padded), IGNORE_INDEX)
        shift_labels[:, : seq - 1] = labels[:, 1:]
        positions = torch.arange(padded, device=input_ids.device).expand(batch, padded)

        def shard(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, state.cp_size, state.cp_rank, dim=1, layout=state.layout)

        with per_token_labels(), _unless(padded == seq, _PADDED.format(seq=seq, padded=padded)):
            out = self.model(
                input_ids=shard(ids),
                position_ids=shard(positions),
                shift_labels=shard(shift_labels),
                fused_lm_head=True,
                use_cache=False,
            )
        return _whole_rows(
            out, lambda local: gather_rows(local, state.cp_group, state.cp_size, state.layout)[:, : seq - 1])

    def _packed_forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                        attention_mask: Optional[torch.Tensor]) -> Any:
        """The rows (right-padded ``(batch, seq)``) as one packed row: its shard through the
        model with the document boundaries, its per-token fields gathered and unpacked."""
        state = self.state
        batch, seq = input_ids.shape
        lengths = (attention_mask.long().sum(dim=1) if attention_mask is not None
                   else torch.full((batch,), seq, dtype=torch.long, device=input_ids.device))
        packed = pack_rows(input_ids, labels, lengths, 2 * state.cp_size, self.pad_token_id)
        cu = packed.cu_seqlens

        def shard(t: torch.Tensor) -> torch.Tensor:
            return shard_packed(t, cu, state.cp_size, state.cp_rank, dim=1)

        with per_token_labels(), draws_refused(_PACKED):
            out = self.model(
                input_ids=shard(packed.input_ids),
                position_ids=shard(packed.position_ids),
                shift_labels=shard(packed.shift_labels),
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu.clone(),
                max_length_q=packed.max_length,
                max_length_k=packed.max_length,
                fused_lm_head=True,
                use_cache=False,
            )
        return _whole_rows(out, lambda local: unpack_field(
            gather_rows(local, state.cp_group, state.cp_size, state.layout, cu), packed))
