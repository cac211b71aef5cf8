"""Context-parallel patterns: the ring (``ring/``), all-gather, Ulysses and hybrid, the
(out, lse) merge, the one plan of a call (``plan.AttentionPlan``, built by ``build``, run
by ``run.run_plan``), ``auto``'s rule, the public ops (``api``) and the active
context-parallel state (``state``: layout, pattern, kernel over the dp x cp groups).

Must not import transformers, accelerate, or hf_ring's integration (hf), memory or
training layers.
"""

from hf_ring.distributed.comm import CommWaitStats, VirtualRing
from hf_ring.patterns.api import context_parallel_attn_func, ring_flash_attn_func, ring_flash_attn_varlen_func
from hf_ring.patterns.build import build_plan
from hf_ring.patterns.plan import PATTERNS, AttentionPlan
from hf_ring.patterns.run import run_plan
from hf_ring.patterns.state import (
    ContextParallelState,
    context_parallel_suspended,
    get_context_parallel_state,
    set_context_parallel_state,
    setup_context_parallel,
)

__all__ = [
    "AttentionPlan",
    "CommWaitStats",
    "PATTERNS",
    "ContextParallelState",
    "VirtualRing",
    "build_plan",
    "context_parallel_attn_func",
    "context_parallel_suspended",
    "get_context_parallel_state",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "run_plan",
    "set_context_parallel_state",
    "setup_context_parallel",
]
