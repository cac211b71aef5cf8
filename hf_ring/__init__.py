"""hf_ring: context parallelism (ring attention) for Hugging Face Transformers and Accelerate.

``import hf_ring`` registers the attention implementation ``"ring_flash"`` with
transformers (when transformers is installed; when its import or a patch's check fails, the
core still imports and ``ring_flash`` is refused when asked for, naming the error:
``hf_ring.hf.availability``). The core works without it: ``sharding``
(which tokens a rank holds), ``kernels`` (one blockwise attention call and the kernel
policy), ``distributed`` (the dp x cp groups, the transport), ``patterns`` (ring,
all-gather, Ulysses, hybrid: one plan per call, one entry point) and ``wrap``
(``ContextParallel.wrap``). On top: ``hf`` (the transformers integration), ``memory``
(chunked loss, offload, tiled MLP) and ``training`` (plugin, collator, loss, Trainer,
sharded weights, TRL). The repository's docs/design.md has the layers and what each must
not import.
"""

from hf_ring.hf import availability as _ring_flash
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
# when transformers is installed; the core above needs only torch, so a failure here is
# kept and raised when ring_flash is asked for (hf_ring.hf.availability).
_ring_flash.register_if_installed()

# The collator and the Accelerate plugin need only torch; the Trainer needs transformers.
from hf_ring.training.collator import RingCollatorConfig, RingDataCollator
from hf_ring.training.plugin import RingAttentionPlugin
from hf_ring.training.vision.collator import RingVisionCollatorConfig, RingVisionDataCollator

__all__ += ["RingCollatorConfig", "RingDataCollator", "RingAttentionPlugin", "RingVisionCollatorConfig",
            "RingVisionDataCollator"]

_NEEDS_RING_FLASH = ["ChunkedLossConfig", "RingTrainer", "ShardedCache", "enable_offloaded_checkpointing",
                     "enable_sequence_parallel", "tile_mlps"]
if _ring_flash.registered():
    from hf_ring.hf.generation import ShardedCache
    from hf_ring.memory.chunked_loss import ChunkedLossConfig
    from hf_ring.memory.offload import enable_offloaded_checkpointing
    from hf_ring.memory.sequence_parallel import enable_sequence_parallel
    from hf_ring.memory.tiled_mlp import tile_mlps
    from hf_ring.training.trainer import RingTrainer

    __all__ += _NEEDS_RING_FLASH


def __getattr__(name: str):
    # Reached only for names not set above: the transformers-dependent ones say why they are absent.
    if name in _NEEDS_RING_FLASH:
        _ring_flash.require(f"hf_ring.{name}")
    raise AttributeError(f"module 'hf_ring' has no attribute {name!r}")
