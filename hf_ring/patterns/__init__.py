"""Ring layer: the ring algorithms, the (out, lse) merge, the transport and autograd, and
the dp x cp process groups.

Never imports transformers or accelerate.
"""

from hf_ring.patterns.api import ring_attention, ring_flash_attn_func, ring_flash_attn_varlen_func
from hf_ring.distributed.comm import CommWaitStats, VirtualRing
from hf_ring.distributed.groups import (
    ContextParallelState,
    get_context_parallel_state,
    set_context_parallel_state,
    setup_context_parallel,
)
from hf_ring.patterns.dispatch import PATTERNS, context_parallel_attn_func
from hf_ring.patterns.plan import RingPlan

__all__ = [
    "CommWaitStats",
    "PATTERNS",
    "ContextParallelState",
    "RingPlan",
    "VirtualRing",
    "context_parallel_attn_func",
    "get_context_parallel_state",
    "ring_attention",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "set_context_parallel_state",
    "setup_context_parallel",
]
