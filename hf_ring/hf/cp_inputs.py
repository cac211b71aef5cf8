"""Checks, once per model forward, that the inputs are ones the ring can serve.

Why here and not in every attention layer: these properties belong to the batch (shapes,
padding, positions, documents, cache), so one check per forward is enough. Under context
parallelism it is collective: one all-gather of a fixed-length header over the CP group
(batch, local length, documents, layout, pattern, largest position, whether this rank found a
problem), plus, only when a padding mask is given, one all-gather of a ``(batch, 2)`` summary. So
ranks that disagree, or a rank whose inputs are refused, raise an error on *every* rank
instead of leaving the others waiting in the ring (or, with different shapes, aborting
gloo or hanging NCCL). The number of collectives does not depend on the number of layers.

Under CP every rank feeds its shard of the sequence (``hf_ring.shard_sequence``, or
``hf_ring.sharding.shard_packed`` for packed rows) with the *global* ``position_ids``:
RoPE runs in the model on those positions, and the ring's causal mask follows the layout
(held in the state). Right padding needs no mask at all under a causal mask (no real
token attends to a later one), so a 2-D right-padding ``attention_mask`` is accepted and
then dropped; every other mask is refused.

A multimodal model runs differently (``hf_ring.hf.multimodal``): every rank holds the same
full batch, the model merges its image features and computes its own positions (Qwen's 3-D
M-RoPE) on the full sequence, and hf_ring shards them at the language model's entry. Those
inputs come marked (:class:`FullBatchShards`): their positions are the model's, not
``arange``'s, and the header carries a digest of the full batch, which must agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from hf_ring.hf.forward_context import FullBatchShards
from hf_ring.hf.randomness.draws import generator_digest
from hf_ring.patterns.api import documents_fields
from hf_ring.distributed.comm import peer_failed
from hf_ring.patterns.state import ContextParallelState
from hf_ring.patterns.plan import PATTERNS
from hf_ring.patterns.validation import check_agreement, dtype_code, layout_code, name_code
from hf_ring.hf.row_indices import (
    document_bounds, expected_positions, global_indices, packed_document_lengths, placed_documents, rows_and_length,
)
from hf_ring.sharding.placement import PLACEMENTS, DocumentPlacement, places_documents

_PATTERN_CODES = (*PATTERNS, "auto")
_HINT = (
    "every rank of a CP group must run the same forward on its shard of the same batch: "
    "build batches with RingDataCollator and feed them through RingAttentionPlugin (or "
    "plugin.attach(accelerator)), which gives every rank of a CP group the same batch (a "
    "multimodal model takes the same full batch on every rank: hf_ring shards it at its language model)"
)


def _cache_argument(inputs: dict[str, Any]) -> Optional[Any]:
    # transformers 5 calls it `cache` (with `past_key_values` deprecated), 4.57 `past_key_values`.
    for name in ("cache", "past_key_values"):
        if inputs.get(name) is not None:
            return inputs[name]
    return None


def _refuse_cache(inputs: dict[str, Any], state: ContextParallelState) -> None:
    """A cache hf_ring did not prepare: text models generate under CP through
    ``hf_ring.hf.generation``, which shards the prompt into a ``ShardedCache`` before this
    check; what reaches it otherwise (an image-text model's language model, a model guarded
    by hand without those hooks) would keep this rank's shard of K/V in a cache that does
    not know it."""
    # cache_position too: Llama 4's 4.57 layers number tokens from it (sequence_features.py).
    if (_cache_argument(inputs) is not None or inputs.get("cache_position") is not None
            or inputs.get("use_cache") is True):
        raise NotImplementedError(
            f"a KV cache (use_cache=True, a cache or cache_position) reached this model's layers under context "
            f"parallelism (cp_size={state.cp_size}) without hf_ring's generation hooks, so it would hold this "
            "rank's shard of K/V as if it were the sequence's. Text models loaded with ring_flash generate under "
            "CP (model.generate on every rank of the group); for this one pass use_cache=False, or generate "
            "without CP: with hf_ring.context_parallel_suspended(): model.generate(...)"
        )


def _refuse_local(
    inputs: dict[str, Any], state: ContextParallelState, shards: Optional[FullBatchShards]
) -> Optional[tuple[int, ...]]:
    """What a rank can refuse from its own inputs; returns the packed document lengths."""
    own_positions = shards is not None
    if shards is None or shards.generation is None:
        _refuse_cache(inputs, state)
    doc_lens = packed_document_lengths(inputs, state.cp_size)
    mask = inputs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"ring_flash under context parallelism takes no {mask.dim()}-D attention_mask: the ring "
            "computes causal attention over the global positions (and per document for packed rows "
            "with cu_seq_lens_q); pass a 2-D right-padding mask or none"
        )
    positions = inputs.get("position_ids")
    if positions is None:
        raise ValueError(
            "ring_flash under context parallelism needs the global position_ids of this rank's "
            "shard (shard_sequence(arange(seq_len)[None], cp_size, cp_rank), as RingDataCollator "
            "emits): without them the model numbers the local tokens 0..local_len-1 and RoPE is wrong. "
            "A model without positions (Mamba) takes them through its keyword arguments too: hf_ring "
            "checks the shard's layout from them"
        )
    # A model's own positions may come with a leading axis (M-RoPE's (3, batch, local_seq)).
    dims = (1, 2, 3) if own_positions else (1, 2)
    if not isinstance(positions, torch.Tensor) or positions.dim() not in dims or positions.dtype.is_floating_point:
        raise ValueError(
            f"position_ids must be an integer tensor (batch or 1, local_seq), got {type(positions).__name__} "
            f"{tuple(getattr(positions, 'shape', ()))}"
        )
    batch, seq_local = rows_and_length(inputs)
    rows = positions.shape[-2] if positions.dim() >= 2 else 1
    if rows not in (1, batch) or positions.shape[-1] != seq_local or (
        mask is not None and tuple(mask.shape) != (batch, seq_local)
    ):
        raise ValueError(
            f"position_ids {tuple(positions.shape)} and attention_mask "
            f"{None if mask is None else tuple(mask.shape)} must match the inputs' (batch, local_seq) "
            f"= {(batch, seq_local)}"
        )
    return doc_lens


def compute_dtype(model: Any, device: torch.device) -> tuple[Optional[torch.dtype], bool]:
    """The dtype attention will run in (autocast's, else the first floating parameter's),
    and whether autocast is on: ranks that differ would send messages of other sizes."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type), True
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None), False


def inputs_device(inputs: dict[str, Any]) -> torch.device:
    """The device of a forward's tensor inputs (where the check's collective runs)."""
    return next((t.device for t in inputs.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _positions_wrong(inputs: dict[str, Any], index: torch.Tensor, doc_lens) -> torch.Tensor:
    """0-d int64 on the inputs' device: 1 where a real token has a non-global position."""
    positions = inputs["position_ids"]
    expected = expected_positions(index, doc_lens).to(positions.device)
    wrong = positions != expected
    mask = inputs.get("attention_mask")
    if mask is not None:
        # Positions of padding tokens do not matter: nothing real attends to them.
        wrong = wrong & (mask.to(positions.device) != 0)
    return wrong.any().to(torch.int64)


def _check_right_padding(mask: torch.Tensor, index: torch.Tensor, state: ContextParallelState) -> None:
    """Collective: refuse a padding token before a real one anywhere in a full row."""
    keep = mask.to(torch.bool)
    index = index.to(mask.device).expand_as(keep)
    last_real = torch.where(keep, index, torch.full_like(index, -1)).amax(dim=1)
    first_pad = torch.where(keep, torch.full_like(index, 1 << 62), index).amin(dim=1)
    mine = torch.stack([last_real, first_pad], dim=1)  # (batch, 2)
    gathered = [torch.empty_like(mine) for _ in range(state.cp_size)]
    torch.distributed.all_gather(gathered, mine, group=state.cp_group)
    both = torch.stack(gathered)  # (cp, batch, 2)
    if bool((both[..., 0].amax(dim=0) > both[..., 1].amin(dim=0)).any()):
        raise ValueError(
            "ring_flash under context parallelism accepts only right padding (padding tokens at "
            "the end of each row, as RingDataCollator pads): this attention_mask has a padding "
            "token before a real one (left padding or holes); pad on the right instead"
        )


class CheckedInputs(NamedTuple):
    """What :func:`validate_cp_inputs` learnt of a forward: a packed row's global document
    lengths (None: dense rows), the global batch's largest position id (padding included:
    what the full sequence's RoPE reads its length from), ``token_index``, int64
    ``(seq_local,)`` on the CPU: the global row index of each of this rank's tokens, and
    ``generator_digests``: each CP rank's digest of its random generators (randomness/draws.py),
    ``placement``: under ``placement="by_length"``, where the packed row's documents went."""

    doc_lens: Optional[tuple[int, ...]]
    max_position: int
    token_index: torch.Tensor
    generator_digests: tuple[int, ...]
    placement: Optional[DocumentPlacement] = None


def validate_cp_inputs(
    inputs: dict[str, Any], state: ContextParallelState, compute_dtype: Optional[torch.dtype] = None,
    autocast: bool = False, shards: Optional[FullBatchShards] = None, refused: Optional[Exception] = None,
) -> CheckedInputs:
    """Validate one forward's inputs under CP (``state.cp_size > 1``); collective over
    ``state.cp_group``: one all-gather of a fixed-length header, plus one of a ``(batch, 2)``
    mask summary when an ``attention_mask`` is given; one host sync for each.

    Args:
        inputs: the base model's forward arguments by name: ``input_ids`` / ``inputs_embeds``
            ``(batch, seq_local[, hidden])``, ``position_ids`` ``(batch or 1, seq_local)``
            int, ``attention_mask`` ``(batch, seq_local)`` 0/1 or None, optionally
            ``cu_seq_lens_q`` / ``cu_seq_lens_k`` int ``(n_docs + 1,)``, ``cache`` /
            ``past_key_values``, ``use_cache``.
        state: the active context-parallel state.
        compute_dtype: the dtype attention will run in (autocast's, else the model's), which
            every rank must share: the ring's messages are sized by it.
        autocast: whether the forward runs under autocast.
        shards: set when hf_ring sharded these inputs itself from a full batch (a multimodal
            model): the positions are the model's own, and the full batch's digest must agree.
        refused: what a hook before the guard refused in these inputs, raised here.

    Returns:
        The documents, largest position and this rank's token indices (:class:`CheckedInputs`).

    Raises (on every rank of the CP group):
        NotImplementedError: a KV cache, ``cache_position`` or ``use_cache=True`` not prepared by
            hf_ring's generation hooks.
        ValueError: inputs that differ across the ranks, missing or non-global
            ``position_ids``, a mask other than right padding, packed rows with batch size > 1
            or a padding mask.
    """
    problem: Optional[Exception] = None
    doc_lens = placement = None
    batch, seq_local = rows_and_length(inputs)
    device = inputs_device(inputs)
    wrong = top = None
    try:
        if refused is not None:
            raise refused
        doc_lens = _refuse_local(inputs, state, shards)
        placement = placed_documents(doc_lens, seq_local, state, shards)
        index = global_indices(seq_local, doc_lens, state, placement)
        # The model's own positions (M-RoPE) are not arange's: the digest vouches for them.
        wrong = _positions_wrong(inputs, index, doc_lens) if shards is None else torch.zeros((), dtype=torch.int64)
        top = inputs["position_ids"].max()
    except Exception as e:  # noqa: BLE001 - re-raised below, after the header went round
        # Whatever this rank's inputs broke, the other ranks must hear of it rather than
        # wait for a header that never comes.
        problem = e
    mask = inputs.get("attention_mask")
    fields = [
        ("refused", int(problem is not None)),
        ("positions_not_global", 0),
        # Each rank's largest position id: the batch's is their maximum (dynamic RoPE reads it).
        ("max_position", -1),
        # hf_ring's shards of one full batch (a multimodal model): every rank must hold the same.
        ("full_batch_digest", 0),
        # Random draws are made as one process makes them only where every rank's generators
        # agree; checked at the first draw (a forward that draws nothing may differ).
        ("generators", generator_digest(device)),
        ("batch", batch),
        # Under by-length placement the ranks' rows differ in length (the documents' hash and
        # the placement field below make them agree on the plan instead).
        ("local_seq", seq_local),
        ("placement", PLACEMENTS.index(state.placement)),
        ("max_tokens_per_rank", state.max_tokens_per_rank or 0),
        ("attention_mask", int(mask is not None)),
        ("cp_size", state.cp_size),
        ("layout", layout_code(state.layout)),
        # pattern="auto" picks from these on every rank: ranks that differ would pick apart.
        ("pattern", _PATTERN_CODES.index(state.pattern)),
        ("ulysses_size", state.ulysses_size or 0),
        # Kernels that differ in what they compute would refuse a layer on some ranks only.
        ("kernel", name_code(state.kernel)),
        ("local_world_size", state.local_world_size),
        ("autocast", int(autocast)),
        ("compute_dtype", dtype_code(compute_dtype)),
        *documents_fields(document_bounds(doc_lens) if doc_lens else []),
    ]
    header = torch.tensor([v for _, v in fields], dtype=torch.int64, device=device)
    if wrong is not None:
        header[1] = wrong
        header[2] = top
    if shards is not None:
        header[3] = shards.digest
    try:
        rows = check_agreement(state.cp_group, fields, device, "the model's inputs", _HINT,
                               ignore=("refused", "positions_not_global", "max_position", "generators")
                               + (("local_seq",) if places_documents(state.placement) else ()), values=header)
    except RuntimeError as e:
        if not peer_failed(e):
            raise
        raise RuntimeError(
            f"CP rank {state.cp_rank} waited (up to {state.timeout}) for the other ranks of its "
            "context-parallel group to run this forward, and they did not: every rank of a CP group must "
            "run every forward of a ring_flash model together (a forward on the main process only, "
            "a sanity check or generate() on one rank, or ranks that took different branches hang "
            "or fail like this). The timeout is RingAttentionPlugin(timeout=...) (seconds), or setup_context_parallel(timeout=...)"
        ) from e
    refused = [r for r, row in enumerate(rows) if row[0]]
    if problem is not None:
        raise problem
    if refused:
        raise ValueError(f"CP rank(s) {refused} refused this forward's inputs (see the error there); {_HINT}")
    bad_positions = [r for r, row in enumerate(rows) if row[1]]
    if bad_positions:
        what = "per-document positions of the packed row" if doc_lens else f"layout {state.layout!r}"
        raise ValueError(
            f"position_ids on CP rank(s) {bad_positions} are not the global positions of their shard "
            f"({what}, the layout of the active context-parallel state): shard position_ids exactly "
            "like input_ids, from arange(seq_len) over the full padded sequence (RingDataCollator "
            "does); a collator sharding in another layout than the state's is a mismatch"
        )
    if mask is not None:
        _check_right_padding(mask, index, state)
    generators = tuple(row[[name for name, _ in fields].index("generators")] for row in rows)
    return CheckedInputs(doc_lens, max(row[2] for row in rows), index, generators, placement)
