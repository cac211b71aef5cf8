"""Monkey-patches of transformers internals that ``attn_implementation="ring_flash"`` needs,
and every private internal of transformers that hf_ring reads.

Written for transformers 4.57.6 (the last 4.x, the oldest with the attention registry),
5.24.0 and 5.25.0 (re-read: what changed is said where it is read, in ``mixers`` and
``sources``); applied to the release lines they belong to (4.57.x and 5.x; a 5.x newer than
the highest tested with one warning, behind the shape checks below) and refused, with an error that
says what to install, on any other version (``versions``; the table of tested ranges is
``hf_ring.patches.versions``).

The patches (``hooks.apply``):

1. ``flash_name_check`` (5.x only). Transformers 5 takes every implementation name
   containing "flash" for a flash-attention kernel (``utils.generic.
   is_flash_attention_requested``): model creation then tries to load ``ring_flash`` from
   the Hub and fails with "Could not find the currently requested flash attention
   implementation at `ring_flash`", models whose ``_compatible_flash_implementations`` is
   set would silently swap it for a Hub kernel, and vision encoders, generation and mask
   code switch to flash calling conventions (unpadded 2-D masks, ``cu_seqlens``).
   ``ring_flash`` follows SDPA's conventions (4-D masks without context parallelism), so
   the check is wrapped to answer False for it and exactly as before for every other
   name. 4.57.x compares names exactly (``== "flash_attention_2"``,
   ``startswith("flash_attention")``) and needs no such patch.
2. ``model_hook`` (4.57.x and 5.x). ``PreTrainedModel.post_init`` and
   ``set_attn_implementation`` call a hook after they ran, so that every model that asks
   for ``ring_flash`` gets the guard that detects a bypassed ring
   (``hf_ring.hf.guard``) without the user doing anything.

3. ``mixers.route`` (5.x only; ``hf_ring.hf.guard`` calls it for each guarded model): the
   gated delta net layers of Qwen3.5 (dense, MoE), Qwen3-Next and OLMo hybrid call
   ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` of their modeling module, which
   under context parallelism would see only this rank's shard; both names are replaced
   with wrappers that run hf_ring's context-parallel mixers when the forward's context asks.

Each patch checks that what it replaces has the shape it was written for, and raises
``UnsupportedTransformersVersion`` otherwise. ``apply`` is idempotent.

The private internals hf_ring reads are read here too, through accessors that check the
installed release line and the internal's shape first, so that a transformers release
that renames or reshapes one fails with a clear error instead of a wrong answer (the same
in 4.57.6 and 5.24.0):

- ``attributes``: ``config._attn_implementation`` (``attn_implementation``; transformers
  has no public reader of it), ``Trainer._train_batch_size`` (``train_batch_size``:
  ``auto_find_batch_size`` changes it, so the argument's value may be stale),
  ``Trainer._prepare_inputs`` (``prepare_inputs``: what moves a batch to the device before
  the model's forward; the stock ``prediction_step`` calls it first),
  ``PreTrainedModel._set_gradient_checkpointing`` (``set_checkpoint_function``: to
  checkpoint layers with hf_ring's CPU-offloading checkpoint), a layer's
  ``_gradient_checkpointing_func`` (``wrap_checkpoint_function``: a recompute draws its
  random numbers as the forward did, under CP), ``Trainer.gather_function``
  (``eval_gather_replaced``: under CP the eval losses are gathered over data-parallel ranks),
  whether ``DistributedConfig`` takes ``tp_size`` / ``fsdp_size`` (``distributed_config_takes_sizes``),
  the forward tensor parallelism installs on a module (``tensor_parallel_forward``: the
  chunked loss runs in place of the LM head's, vocabulary-sharded, and puts it back), and
  whether that forward leaves a module's input and output whole (``tensor_parallel_output_whole``:
  which token mixers and vision towers TP leaves whole, read from what was applied), and the
  Trainer's checkpoint steps a Ring trainer overrides under pipeline parallelism
  (``check_checkpoint_methods``: ``_load_from_checkpoint``, ``_save_optimizer_and_scheduler``,
  ``_load_optimizer_and_scheduler``);
- ``sources``: what is read from the modeling code itself: a causal LM's logit transform
  (``logit_transform``, for the chunked loss), whether a forward passes a keyword
  (``forward_passes_keyword``), a modeling module's attention-class tables and whether it
  dispatches through the attention interface (``attention_class_tables``,
  ``uses_attention_interface``), whether a forward hands its keyword arguments on
  (``forward_reads_keywords``), for model support;
- ``rope``: which rotary embeddings pick their frequencies from the largest position they
  are given (``length_dependent_rope``, ``reads_max_position``), and hooks that hand them
  the full sequence's under context parallelism (``hand_max_position``, ``set_max_position``);
- ``temperature``: the query scale of Llama 4's attention temperature tuning, which its
  layers compute from positions numbered within the forward (``query_temperature``,
  ``temperature_scale``);
- ``positions``: the positions a Qwen-VL base model computes for itself
  (``compute_3d_position_ids``, called per packed document by ``own_position_ids``, leaving
  the model's ``rope_deltas`` as it found them).

Defects of transformers' own code that model support refuses around are recorded, with the
release they were read on, in ``defects`` (Gemma 3's mask on packed rows).

transformers is imported only when a function runs: ``import hf_ring`` needs only torch.
"""

from .attributes import (
    attn_implementation,
    check_checkpoint_methods,
    distributed_config_takes_sizes,
    drop_absent_no_split_modules,
    eval_gather_replaced,
    prepare_inputs,
    set_checkpoint_function,
    tensor_parallel_forward,
    tensor_parallel_output_whole,
    train_batch_size,
    wrap_checkpoint_function,
)
from .hooks import apply
from .rope import hand_max_position, length_dependent_rope, reads_max_position, set_max_position
from .sources import (
    attention_class_tables,
    forward_passes_keyword,
    forward_reads_keywords,
    logit_transform,
    uses_attention_interface,
)
from .temperature import query_temperature, temperature_scale
from .versions import WRITTEN_FOR, UnsupportedTransformersVersion, release_line

__all__ = [
    "WRITTEN_FOR",
    "UnsupportedTransformersVersion",
    "apply",
    "attention_class_tables",
    "attn_implementation",
    "check_checkpoint_methods",
    "distributed_config_takes_sizes",
    "drop_absent_no_split_modules",
    "eval_gather_replaced",
    "forward_passes_keyword",
    "forward_reads_keywords",
    "hand_max_position",
    "length_dependent_rope",
    "logit_transform",
    "prepare_inputs",
    "query_temperature",
    "reads_max_position",
    "release_line",
    "set_checkpoint_function",
    "set_max_position",
    "temperature_scale",
    "tensor_parallel_forward",
    "tensor_parallel_output_whole",
    "train_batch_size",
    "uses_attention_interface",
    "wrap_checkpoint_function",
]
