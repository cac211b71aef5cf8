"""hf_ring: context parallelism (ring attention) for Hugging Face Transformers and Accelerate.

``import hf_ring`` registers the attention implementation ``"ring_flash"`` with
transformers (when transformers is installed). The core works without it: ``sharding``
(which tokens a rank holds), ``kernels`` (one blockwise attention call and the kernel
policy), ``distributed`` (the dp x cp groups, the transport), ``patterns`` (ring,
all-gather, Ulysses, hybrid: one plan per call, one entry point) and ``wrap``
(``ContextParallel.wrap``). On top: ``hf`` (the transformers integration), ``memory``
(chunked loss, offload, tiled MLP) and ``training`` (plugin, collator, loss, Trainer,
sharded weights, TRL). The repository's docs/design.md has the layers and what each must
not import.
"""

import importlib.util

from hf_ring.patterns import (
    ContextParallelState,
    context_parallel_attn_func,
    context_parallel_suspended,
    get_context_parallel_state,
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    set_context_parallel_state,
    setup_context_parallel,
)
from hf_ring.wrap.context_parallel import ContextParallel
from hf_ring.sharding import shard_sequence, unshard_sequence

__version__ = "0.1.0"

__all__ = [
    "ContextParallel",
    "ContextParallelState",
    "context_parallel_attn_func",
    "context_parallel_suspended",
    "get_context_parallel_state",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "set_context_parallel_state",
    "setup_context_parallel",
    "shard_sequence",
    "unshard_sequence",
]

# Registers attn_implementation="ring_flash" (and applies hf_ring.patches.transformers)
# when transformers is installed; the core above needs only torch.
if importlib.util.find_spec("transformers") is not None:
    from hf_ring.hf.registration import register as _register_ring_flash

    _register_ring_flash()

# The collator and the Accelerate plugin need only torch; the Trainer needs transformers.
from hf_ring.training.collator import RingCollatorConfig, RingDataCollator
from hf_ring.training.plugin import RingAttentionPlugin

__all__ += ["RingCollatorConfig", "RingDataCollator", "RingAttentionPlugin"]

if importlib.util.find_spec("transformers") is not None:
    from hf_ring.memory.chunked_loss import ChunkedLossConfig
    from hf_ring.memory.offload import enable_offloaded_checkpointing
    from hf_ring.memory.tiled_mlp import tile_mlps
    from hf_ring.training.trainer import RingTrainer

    __all__ += ["ChunkedLossConfig", "RingTrainer", "enable_offloaded_checkpointing", "tile_mlps"]
