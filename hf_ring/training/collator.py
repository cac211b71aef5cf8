"""Turn rows of token ids into this context-parallel rank's shard of a training batch.

Everything that depends on the *whole* sequence happens here, before sharding, because
after sharding no rank sees the whole sequence: labels are shifted on the full row (the
token that predicts position ``t + 1`` may live on another rank), position ids are the
global ones, and the row is padded at the end to a length the layout can split evenly.
Then each tensor is cut to the piece this rank holds (zigzag by default).

Two modes:

- dense (default): one row per example, padded at the end to the batch's longest row
  rounded up to a multiple of ``2 * cp_size`` (zigzag) or ``cp_size``;
- packing: all examples of the batch go into ONE row, each document padded to a multiple of
  ``2 * cp_size`` and zigzag-sharded on its own (``hf_ring.sharding.shard_packed``), with
  position ids restarting at 0 per document and the global document boundaries as
  ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, identical on every rank), which
  ``ring_flash`` reads from the model's kwargs (``hf_ring.hf.attention``). With
  ``placement="by_length"`` short documents stay whole on one rank and only long ones are
  sharded (``hf_ring.sharding.placement``): the ranks' rows then differ in length;
  ``placement="auto"`` plans each row so, or shards every document, whichever is modelled cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from hf_ring.patterns.state import ContextParallelState
from hf_ring.sharding import required_multiple, shard_packed, shard_sequence
from hf_ring.sharding.labels import IGNORE_INDEX
from hf_ring.sharding.layouts import check_layout
from hf_ring.sharding.placement import check_placement_settings, places_documents, shard_placed
from hf_ring.sharding.placement_auto import plan_placement


@dataclass(frozen=True)
class RingCollatorConfig:
    """Settings of :class:`RingDataCollator`, validated on creation.

    Attributes:
        pad_token_id: id written into padding positions of ``input_ids``.
        cp_size: ranks per context-parallel group.
        cp_rank: this process's rank in its context-parallel group.
        layout: ``"zigzag"``, ``"stripe"`` or ``"contiguous"``; must match the attention's.
        pad_to_multiple_of: pad rows (dense) or documents (packing) to a multiple of this;
            must itself be a multiple of what the layout needs (default: exactly that).
        packing: pack the batch's examples into one row (needs the zigzag layout).
        return_attention_mask: also emit a right-padding ``attention_mask`` (dense only). With
            right padding and a causal mask no real token attends to padding, so the default
            is to leave it out.
        placement: ``"sharded"`` (every packed document cut over the CP group) or
            ``"by_length"`` (short documents whole on one rank, long ones sharded, balanced:
            ``hf_ring.sharding.placement``) or ``"auto"`` (per row, by length or every
            document sharded, whichever is modelled cheaper); must match the state's. Packing only.
        max_tokens_per_rank: ``by_length`` and ``auto`` only: the most tokens one rank may hold (None: no bound).
    """

    pad_token_id: int
    cp_size: int = 1
    cp_rank: int = 0
    layout: str = "zigzag"
    pad_to_multiple_of: Optional[int] = None
    packing: bool = False
    return_attention_mask: bool = False
    placement: str = "sharded"
    max_tokens_per_rank: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative int, got {self.pad_token_id!r}")
        check_coordinates(self)
        if self.packing and self.layout != "zigzag":
            raise ValueError(
                f"packing shards every document in the zigzag layout, got layout={self.layout!r}; "
                "use layout='zigzag' with packing=True"
            )
        if self.packing and self.return_attention_mask:
            raise ValueError(
                "packing=True separates documents with cu_seq_lens_q/k and per-document "
                "position_ids; an attention_mask cannot express that, so set "
                "return_attention_mask=False"
            )
        check_placement_settings(self.placement, self.max_tokens_per_rank)
        if places_documents(self.placement) and not self.packing and self.cp_size > 1:
            raise ValueError(
                f"placement={self.placement!r} places the documents of a packed row; padded batches (one document "
                "a row) are not placed by length yet: pass packing=True (or placement='sharded')"
            )
        base = self.base_multiple
        if self.pad_to_multiple_of is not None:
            if not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1:
                raise ValueError(f"pad_to_multiple_of must be a positive int, got {self.pad_to_multiple_of!r}")
            if self.pad_to_multiple_of % base != 0:
                raise ValueError(
                    f"pad_to_multiple_of={self.pad_to_multiple_of} is not a multiple of {base}, "
                    f"which the {'packed ' if self.packing else ''}{self.layout!r} layout needs with "
                    f"cp_size={self.cp_size}; use a multiple of {base}"
                )

    @property
    def base_multiple(self) -> int:
        """The length multiple the layout itself needs."""
        return 2 * self.cp_size if self.packing else required_multiple(self.cp_size, self.layout)

    @property
    def multiple(self) -> int:
        """The length multiple rows (dense) or documents (packing) are padded to."""
        return self.pad_to_multiple_of or self.base_multiple


def check_coordinates(config: Any) -> None:
    """A collator config's ``cp_size``, ``cp_rank`` and ``layout``, checked (ValueError)."""
    if not isinstance(config.cp_size, int) or config.cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {config.cp_size!r}")
    if not isinstance(config.cp_rank, int) or not 0 <= config.cp_rank < config.cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {config.cp_size}), got {config.cp_rank!r}")
    check_layout(config.layout)


def shards_as(config: Any, state: ContextParallelState) -> bool:
    """Whether a collator config shards as ``state`` says (CP size, rank, layout and placement)."""
    return ((config.cp_size, config.cp_rank, config.layout, getattr(config, "placement", "sharded"),
             getattr(config, "max_tokens_per_rank", None))
            == (state.cp_size, state.cp_rank, state.layout, state.placement, state.max_tokens_per_rank))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _as_ids(value: Any, name: str, index: int) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.numel() == 0:
        raise ValueError(f"example {index} has no tokens in {name}; drop empty examples before collating")
    if t.dim() != 1:
        raise ValueError(f"example {index}: {name} must be a 1-d list of ints, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"example {index}: {name} must hold integers, got {t.dtype}")
    return t.to(torch.long)


def _read_example(feature: Mapping[str, Any], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of one example, both int64 ``(n,)``, n >= 1."""
    if "input_ids" not in feature:
        raise ValueError(f"example {index} has no 'input_ids' (keys: {sorted(feature)})")
    ids = _as_ids(feature["input_ids"], "input_ids", index)
    if feature.get("labels") is not None:
        labels = _as_ids(feature["labels"], "labels", index)
        if labels.shape != ids.shape:
            raise ValueError(
                f"example {index}: labels has {labels.numel()} entries but input_ids has {ids.numel()}; "
                "give one label per token (-100 for tokens that must not be learned)"
            )
    else:
        labels = ids.clone()
    mask = feature.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ValueError(
            f"example {index} is already padded (its attention_mask has zeros); give RingDataCollator "
            "unpadded rows: it pads at the end itself, and padding elsewhere cannot be expressed"
        )
    return ids, labels


def _shift(labels: torch.Tensor) -> torch.Tensor:
    """Labels for next-token prediction: position t learns token t + 1; the last learns nothing."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


class RingDataCollator:
    """Pad, shift labels, build global positions, then keep this rank's shard.

    Call it with a list of examples, each a mapping with ``input_ids`` (list of ints or 1-d
    int tensor, ``n >= 1`` tokens) and optionally ``labels`` (same length, ``-100`` for
    tokens that must not be learned; default: the ids themselves). Returned tensors, where
    ``L`` is the padded full length and ``cp`` the cp_size:

    dense mode (``B`` examples):
        - ``input_ids`` int64 ``(B, L / cp)``, padded with ``pad_token_id``;
        - ``labels`` int64 ``(B, L / cp)``: the unshifted labels (``-100`` on padding);
        - ``shift_labels`` int64 ``(B, L / cp)``: labels shifted on the full row (last token
          and padding ``-100``), what the loss uses;
        - ``position_ids`` int64 ``(B, L / cp)``: global positions;
        - ``attention_mask`` int64 ``(B, L / cp)`` if ``return_attention_mask``.

    packing mode (the batch becomes one row of ``L`` = sum of padded document lengths):
        - ``input_ids``, ``labels``, ``shift_labels``, ``position_ids`` int64 ``(1, L / cp)``,
          labels shifted within each document, positions restarting at 0 per document;
        - ``cu_seq_lens_q``, ``cu_seq_lens_k`` int32 ``(n_docs + 1,)``: global padded document
          boundaries, the same on every rank; ``max_length_q``, ``max_length_k``: ints.

    Args: the fields of :class:`RingCollatorConfig`, or ``config=`` one.
    """

    def __init__(self, pad_token_id: Optional[int] = None, *, config: Optional[RingCollatorConfig] = None, **kwargs: Any):
        if config is not None:
            if pad_token_id is not None or kwargs:
                raise ValueError("pass either config= or the settings as keyword arguments, not both")
            self.config = config
        else:
            if pad_token_id is None:
                raise ValueError("RingDataCollator needs pad_token_id (the id written into padding)")
            self.config = RingCollatorConfig(pad_token_id=pad_token_id, **kwargs)

    @classmethod
    def for_state(cls, state: ContextParallelState, pad_token_id: int, **kwargs: Any) -> "RingDataCollator":
        """A collator that shards exactly as ``state`` says (its CP size, rank and layout):
        the state is the one owner of those, so nothing has to be reconciled later. Beside
        tensor parallelism rows (or documents) are padded to ``tp_size`` times the layout's
        multiple unless ``pad_to_multiple_of`` is given, so that sequence parallelism inside
        TP can halve each rank's tokens (padding adds no token to the loss)."""
        if state.tp_size > 1 and kwargs.get("pad_to_multiple_of") is None:
            base = RingCollatorConfig(pad_token_id, cp_size=state.cp_size, layout=state.layout,
                                      packing=kwargs.get("packing", False)).base_multiple
            kwargs = {**kwargs, "pad_to_multiple_of": base * state.tp_size}
        kwargs = {"placement": state.placement, "max_tokens_per_rank": state.max_tokens_per_rank, **kwargs}
        return cls(pad_token_id, cp_size=state.cp_size, cp_rank=state.cp_rank, layout=state.layout, **kwargs)

    def matches(self, state: ContextParallelState) -> bool:
        """Whether this collator shards as ``state`` says."""
        return shards_as(self.config, state)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if len(features) == 0:
            raise ValueError("RingDataCollator got an empty batch")
        examples = [_read_example(f, i) for i, f in enumerate(features)]
        full = self._packed(examples) if self.config.packing else self._dense(examples)
        return self._shard(full)

    def _dense(self, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        cfg = self.config
        length = _round_up(max(ids.numel() for ids, _ in examples), cfg.multiple)
        batch = len(examples)
        input_ids = torch.full((batch, length), cfg.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((batch, length), dtype=torch.long)
        for row, (ids, lab) in enumerate(examples):
            input_ids[row, : ids.numel()] = ids
            labels[row, : lab.numel()] = lab
            mask[row, : ids.numel()] = 1
        out = {
            "input_ids": input_ids,
            "labels": labels,
            "shift_labels": _shift(labels),
            "position_ids": torch.arange(length).expand(batch, length).clone(),
        }
        if cfg.return_attention_mask:
            out["attention_mask"] = mask
        return out

    def _packed(self, examples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        cfg = self.config
        ids_parts, label_parts, shift_parts, pos_parts, bounds = [], [], [], [], [0]
        for ids, lab in examples:
            n = ids.numel()
            padded = _round_up(n, cfg.multiple)
            doc_ids = torch.full((padded,), cfg.pad_token_id, dtype=torch.long)
            doc_ids[:n] = ids
            doc_labels = torch.full((padded,), IGNORE_INDEX, dtype=torch.long)
            doc_labels[:n] = lab
            ids_parts.append(doc_ids)
            label_parts.append(doc_labels)
            # Shifting per document keeps a document's last token from learning the next one's first.
            shift_parts.append(_shift(doc_labels))
            pos_parts.append(torch.arange(padded))
            bounds.append(bounds[-1] + padded)
        cu = torch.tensor(bounds, dtype=torch.int32)
        max_length = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return {
            "input_ids": torch.cat(ids_parts).unsqueeze(0),
            "labels": torch.cat(label_parts).unsqueeze(0),
            "shift_labels": torch.cat(shift_parts).unsqueeze(0),
            "position_ids": torch.cat(pos_parts).unsqueeze(0),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu.clone(),
            "max_length_q": max_length,
            "max_length_k": max_length,
        }

    def _shard(self, full: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        placement = None
        if cfg.packing and places_documents(cfg.placement):
            bounds = full["cu_seq_lens_q"].tolist()
            doc_lens = tuple(b - a for a, b in zip(bounds, bounds[1:]))
            placement = plan_placement(cfg.placement, doc_lens, cfg.cp_size, cfg.max_tokens_per_rank)
        out = {}
        for key, value in full.items():
            if not (isinstance(value, torch.Tensor) and value.dim() == 2):
                out[key] = value
            elif placement is not None:
                out[key] = shard_placed(value, placement, cfg.cp_rank, dim=1)
            elif cfg.packing:
                out[key] = shard_packed(value, full["cu_seq_lens_q"], cfg.cp_size, cfg.cp_rank, dim=1)
            else:
                out[key] = shard_sequence(value, cfg.cp_size, cfg.cp_rank, dim=1, layout=cfg.layout)
        return out
