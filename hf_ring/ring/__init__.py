"""Ring layer: the ring algorithms, the (out, lse) merge, the P2P ring and autograd.

Never imports transformers or accelerate.
"""

from hf_ring.ring.api import ring_flash_attn_func, ring_flash_attn_varlen_func
from hf_ring.ring.groups import (
    ContextParallelState,
    get_context_parallel_state,
    set_context_parallel_state,
    setup_context_parallel,
)

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "ContextParallelState",
    "get_context_parallel_state",
    "set_context_parallel_state",
    "setup_context_parallel",
]
