"""``ForwardContext``: what one guarded model forward validated, handed down to every
attention layer of that forward.

The guard (guard.py) validates a forward's inputs once (collectively under context
parallelism, see cp_inputs.py) and passes the result into the model's keyword arguments
under :data:`CONTEXT_KWARG`; transformers hands those keyword arguments through the
decoder layers to the attention function, exactly as it hands flash-attention's
``cu_seq_lens_q``. ``ring_flash`` then builds nothing and checks nothing across ranks:
the ring plan (group, layout, backend, the schedule of each step, packed documents as
Python ints) is built once per forward and shared by all layers and by their backward.

The context also records which attention layers ran the ring, so that the guard can
tell, after the forward, whether any layer bypassed it. Nothing here lives in a module
global or a thread-local: a context belongs to one forward call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from hf_ring.kernels import get_backend
from hf_ring.distributed.comm import CommWaitStats
from hf_ring.distributed.groups import ContextParallelState
from hf_ring.patterns.plan import RingPlan

# The keyword the context travels under through the model's forward.
CONTEXT_KWARG = "hf_ring_context"
# The keyword a caller passes to the model's forward to collect the ring's transfer waits.
COMM_STATS_KWARG = "hf_ring_comm_stats"


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
        ran_ring: ids of the attention modules that ran across the CP group (any
            pattern) in this forward.
        choices: ``pattern="auto"``'s choice per kind of attention call in this forward
            (cp_attention.py).
    """

    state: Optional[ContextParallelState]
    doc_lens: Optional[tuple[int, ...]] = None
    comm_stats: Optional[CommWaitStats] = None
    made_by_guard: bool = False
    ran_ring: set[int] = field(default_factory=set)
    choices: dict = field(default_factory=dict)
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.state is not None and self.state.cp_size == 1:
            self.state = None

    @property
    def cp_size(self) -> int:
        return self.state.cp_size if self.state is not None else 1

    def plan(
        self, q: torch.Tensor, scale: float, window: Optional[int] = None, softcap: Optional[float] = None
    ) -> RingPlan:
        """The ring plan for this forward's attention calls on ``q``'s device and dtype
        with ``scale``, sliding ``window`` and logit ``softcap`` (None: none), built on
        first use, then shared by every layer with the same settings (a model alternating
        sliding and full layers gets two plans, each with its own schedule cache)."""
        key = (q.device, q.dtype, scale, window, softcap)
        plan = self._plans.get(key)
        if plan is None:
            s = self.state
            world = self.cp_size
            local_docs = tuple(n // world for n in self.doc_lens) if self.doc_lens is not None else None
            plan = RingPlan(
                group=s.cp_group if s is not None else None,
                rank=s.cp_rank if s is not None else 0,
                world=world,
                layout="zigzag" if local_docs is not None or s is None else s.layout,
                causal=True,
                scale=scale,
                backend=get_backend("auto", q.device, q.dtype, softcap=softcap is not None),
                local_doc_lens=local_docs,
                comm_stats=self.comm_stats,
                window=window,
                softcap=softcap,
            )
            self._plans[key] = plan
        return plan
