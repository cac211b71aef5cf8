"""``ForwardContext``: what one guarded model forward validated, handed down to every
attention layer of that forward.

The guard (guard.py) validates a forward's inputs once (collectively under context
parallelism, see cp_inputs.py) and passes the result into the model's keyword arguments
under :data:`CONTEXT_KWARG`; transformers hands those keyword arguments through the
decoder layers to the attention function, exactly as it hands flash-attention's
``cu_seq_lens_q``. ``ring_flash`` then checks nothing across ranks: the plan of each
kind of attention layer (pattern, with ``"auto"`` resolved; group, layout, kernel, the
schedule of each step, packed documents as Python ints) is built once per forward, at
its first layer, and shared by all layers of that kind and by their backward.

The context also records which attention layers ran the ring, so that the guard can
tell, after the forward, whether any layer bypassed it. Nothing here lives in a module
global or a thread-local: a context belongs to one forward call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from hf_ring.distributed.comm import CommWaitStats
from hf_ring.hf.generation.cache import Generation
from hf_ring.hf.randomness.draws import OneProcessDraws
from hf_ring.hf.support.detectors import Handed
from hf_ring.patterns.state import ContextParallelState
from hf_ring.patterns.build import build_plan
from hf_ring.patterns.run import PlacedPlan
from hf_ring.patterns.plan import AttentionPlan
from hf_ring.patterns.ring.spans import BidirectionalSpans
from hf_ring.sharding.placement import DocumentPlacement

# The keyword the context travels under through the model's forward.
CONTEXT_KWARG = "hf_ring_context"
# The keyword a caller passes to the model's forward to collect the ring's transfer waits.
COMM_STATS_KWARG = "hf_ring_comm_stats"
# The keyword under which hf_ring's own sharding of a full batch marks a forward's inputs.
SHARDED_KWARG = "hf_ring_sharded"
# The keyword under which a hook before the guard hands down what it refused, raised after
# the header went round so that every rank raises (hf_ring.hf.generation.entry).
REFUSED_KWARG = "hf_ring_refused"


@dataclass(frozen=True, eq=False)
class FullBatchShards:
    """Marks inputs that hf_ring sharded itself, from one full batch every rank of the CP
    group holds (a multimodal model's merged embeddings and its own positions, sharded at
    its language model's entry): their ``position_ids`` are the model's own (M-RoPE's
    ``(3, batch, seq_local)`` ones included), so they are not checked against ``arange``;
    ``digest``, 0-d int64 on the inputs' device, summarises the full batch (token ids,
    grids, token types) and must agree across the ranks; ``spans``, the full batch's
    bidirectional spans (Gemma 3's images, read from the token types the digest covers), or
    None: what every attention layer's plan computes on top of causal; ``causal_by_mask``:
    the language model's layers are flagged non-causal, and the mask the model built
    (causal plus the spans) is what they compute (PaliGemma). Without CP (a packed row on
    the varlen ring) only ``spans`` is given, and ``digest`` is None. ``generation``: the
    shards of a prompt ``generate()`` prefills (hf_ring.hf.generation), whose K/V the
    forward keeps in that cache; the digest covers the prompt."""

    digest: Optional[torch.Tensor]
    spans: Optional[BidirectionalSpans] = None
    causal_by_mask: bool = False
    generation: Optional[Generation] = None


@dataclass(eq=False)
class ForwardContext:
    """One forward's validated context.

    Attributes:
        state: the context-parallel state when the forward runs under CP
            (``cp_size > 1``), else None.
        doc_lens: a packed row's global document lengths (validated: each a multiple of
            ``2 * cp_size``), or None for dense rows.
        comm_stats: where the ring adds the time it waited on transfers, or None.
        made_by_guard: set by the guard, the only place that validates a forward's inputs;
            a context passed by hand without it is refused.
        token_index: under CP, int64 ``(seq_local,)`` on the CPU: the global row index of
            each of this rank's tokens (for Llama 4's temperature, sequence_features.py).
        handed: what the model computes outside its attention function that the ring
            computes in it, by layer (windows applied through the mask only, Llama 4's
            temperature), read by model support.
        ran_ring: ids of the attention modules that ran across the CP group (any
            pattern) in this forward.
        ran_mixers: ``(id(layer), function)`` for each mixing function (``"causal_conv1d_fn"``,
            ``"mamba2_chunk_scan"``, ...) a routed token-mixer layer ran on its CP path in
            this forward (``hf.mixers``).
        cache: what the layers of this forward share besides plans (sequence_features.py).
        spans: the full batch's bidirectional spans (Gemma 3's images; under CP validated
            by the guard's digest of the token types; without CP on packed rows only), which
            every attention layer's plan computes on top of causal and its window; None: none.
        draws: under CP, the mode that makes this forward's random draws as one process
            makes them (randomness/draws.py), put in force by randomness/scope.py; None without CP.
        causal_by_mask: the model's attention layers are flagged non-causal but the mask it
            builds (replaced by ``spans``) is causal plus the spans (PaliGemma's
            ``use_bidirectional_attention``): they run the ring's causal plan with the spans.
        placement: under CP with ``placement="by_length"``, where each document of the
            packed row went (``hf_ring.sharding.placement``): the attention runs the sharded
            documents over the group and this rank's whole ones alone (patterns/run.py).
    """

    state: Optional[ContextParallelState]
    doc_lens: Optional[tuple[int, ...]] = None
    comm_stats: Optional[CommWaitStats] = None
    made_by_guard: bool = False
    token_index: Optional[torch.Tensor] = None
    handed: Handed = field(default_factory=Handed)
    ran_ring: set[int] = field(default_factory=set)
    ran_mixers: set[tuple[int, str]] = field(default_factory=set)
    cache: dict = field(default_factory=dict, repr=False)
    spans: Optional[BidirectionalSpans] = None
    causal_by_mask: bool = False
    draws: Optional[OneProcessDraws] = None
    generation: Optional[Generation] = None
    placement: Optional[DocumentPlacement] = None
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.state is not None and self.state.cp_size == 1:
            self.state = None

    @property
    def cp_size(self) -> int:
        return self.state.cp_size if self.state is not None else 1

    def plan(
        self, q: torch.Tensor, n_kv_heads: int, scale: float, window: Optional[int] = None,
        softcap: Optional[float] = None, value_head_dim: Optional[int] = None, chunk: Optional[int] = None,
    ) -> Union[AttentionPlan, PlacedPlan]:
        """The plan for this forward's attention calls like ``q`` ``(batch, seq_local,
        n_heads, head_dim)`` with ``n_kv_heads`` K/V heads (of ``value_head_dim`` for V when
        it differs: multi-head latent attention), ``scale``, sliding ``window``, logit
        ``softcap`` and attention ``chunk`` (None: none): the state's pattern (``"auto"``
        resolved here, once per kind of layer and forward), the state's kernel choice
        resolved for q's device, dtype and these features, built on first use and then
        shared by every layer with the same settings (a model alternating sliding and full
        layers gets two plans, each with its own schedule cache). A packed row placed by
        length gets a :class:`PlacedPlan` of two (its sharded and its whole documents)."""
        key = (q.device, q.dtype, *q.shape[1:], n_kv_heads, value_head_dim, scale, window, softcap, chunk)
        plan = self._plans.get(key)
        if plan is None:
            features = dict(device=q.device, dtype=q.dtype, n_heads=q.shape[2], n_kv_heads=n_kv_heads,
                            head_dim=q.shape[3], value_head_dim=value_head_dim, scale=scale, window=window,
                            softcap=softcap, chunk=chunk)
            if self.placement is None:
                world = self.cp_size
                local_docs = tuple(n // world for n in self.doc_lens) if self.doc_lens is not None else None
                plan = self._build(self.state, local_docs, q.shape[1] * world, **features)
            else:
                plan = self._placed_plan(features)
            self._plans[key] = plan
        return plan

    def _placed_plan(self, features: dict) -> PlacedPlan:
        """The sharded documents' plan over the group and this rank's whole documents' plan
        of one process (None where there are none).

        What the plans compute is decided from the whole row, alike on every rank: a window
        (or chunk) of at least the longest document masks nothing in any document and is
        dropped everywhere, and the kernel is checked once for the row's longest document
        alone, so that a kernel a rank's part would refuse (a named backend without a
        masked kernel) is refused on every rank, never on the ranks whose whole documents
        are longer than the window only (the others would wait in the next collective)."""
        p, s = self.placement, self.state
        longest = max(p.doc_lens)
        features = {**features, **{name: None for name in ("window", "chunk")
                                   if features[name] is not None and features[name] >= longest}}
        self._build(None, (longest,), longest, **features)
        sharded, whole = p.sharded_lens, p.whole_lens(s.cp_rank)
        return PlacedPlan(
            sharded=self._build(s, tuple(n // s.cp_size for n in sharded), sum(sharded), **features) if sharded else None,
            whole=self._build(None, whole, sum(whole), **features) if whole else None,
            sharded_tokens=p.sharded_local_len, whole_tokens=sum(whole),
        )

    def _build(self, s: Optional[ContextParallelState], local_docs: Optional[tuple[int, ...]], seq: int,
               **features) -> AttentionPlan:
        """One plan over ``s``'s CP group (None: this process alone) for ``seq`` global tokens
        (packed: ``local_docs``, each document's local length)."""
        return build_plan(
            pattern=s.pattern if s is not None else "ring",
            group=s.cp_group if s is not None else None,
            rank=s.cp_rank if s is not None else 0,
            world=s.cp_size if s is not None else 1,
            layout="zigzag" if local_docs is not None or s is None else s.layout,
            causal=True,
            seq=seq,
            local_doc_lens=local_docs,
            backend=s.kernel if s is not None else (self.state.kernel if self.state is not None else "auto"),
            ulysses_size=s.ulysses_size if s is not None else None,
            comm_stats=self.comm_stats,
            need_lse=False,
            local_world_size=s.local_world_size if s is not None else 1,
            first_rank=s.first_rank if s is not None else 0,
            rank_stride=s.cp_rank_stride if s is not None else 1,
            spans=self.spans,
            # The state's hybrid subgroups, built up front: a forward never builds a group.
            held_hybrid=s.hybrid if s is not None else None,
            **features,
        )
