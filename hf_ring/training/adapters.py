"""PEFT adapters in a Ring trainer: on a model transformers sharded as it loaded it, and
saved when their weights are sharded.

Beside ``DistributedConfig`` (tensor parallelism, FSDP2 over the dp x cp ranks, applied by
``from_pretrained``), an adapter added afterwards is outside every FSDP2 group:
:func:`prepare_adapters` mends PEFT's tensor-parallel adapters
(``patches.peft.mend_tensor_parallel_widths``), refuses split adapters whose replicas differ
(the stock Trainer broadcasts only the whole ones from rank 0, and then averages their
gradients over the world), and averages every adapter's gradients over the dp x cp ranks in
the backward (``distributed/grad_average.py``), as FSDP2 averages the base weights.

The stock ``Trainer.save_model`` under FSDP writes the model only with a
``FULL_STATE_DICT``; with ``SHARDED_STATE_DICT`` (what
:func:`hf_ring.training.weight_sharding.fsdp_training_arguments` sets, so that checkpoints
stay sharded) it writes nothing and says nothing, and a LoRA run under FSDP2 ends with no
adapter on disk; beside TP PEFT would write each rank's shard of a split adapter. An
adapter is small: its trainable weights are gathered whole (every rank takes part:
``DTensor.full_tensor`` is a collective) and the process that saves writes them with PEFT's
own ``save_pretrained``, as ``adapter_model.safetensors`` that loads into a plain model with
``PeftModel.from_pretrained``.

Must not import TRL.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_ring.distributed.grad_average import average_gradients_over, check_alike_over
from hf_ring.patches import peft as peft_patches


def _sharded_at_load(model: Any) -> bool:
    return bool(getattr(peft_patches.base_model(model), "is_distributed_loading_by_transformers", False))


def prepare_adapters(model: Any, state: Any) -> int:
    """Make the adapter of ``model`` (a ``PeftModel`` over a model transformers sharded at
    load) train as one process would; a no-op for any other model. Call on every rank.

    Args:
        model: the model the trainer was given.
        state: the ``ContextParallelState`` (its ``loss`` axis: the dp x cp ranks of this
            rank's TP coordinate, over which FSDP2 averages the base weights).

    Returns:
        How many adapter weights get their gradients averaged.

    Raises:
        ValueError: split adapter weights that differ between the dp x cp ranks.
        NotImplementedError: ``modules_to_save`` copies (they would run the originals' weights).
    """
    if peft_patches.base_model(model) is model or not _sharded_at_load(model):
        return 0
    copies = peft_patches.modules_to_save_copies(model)
    if copies:
        # PEFT deep-copies the module, and the copy keeps the forward transformers' TP installed on the
        # original (a closure over it): the copy would run the original's weights and train nothing.
        raise NotImplementedError(
            f"modules_to_save ({', '.join(copies[:3])}) on a model transformers sharded as it loaded it: the "
            "trained copies would run the original modules' weights; adapt those modules with LoRA instead")
    peft_patches.mend_tensor_parallel_widths(model)  # and refuses adapters sized from an FSDP2 shard (PEFT 0.21)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    # The Trainer broadcasts the plain ones from rank 0 as training starts; the split ones nobody does.
    split = {name: p for name, p in trainable.items() if hasattr(p, "to_local")}
    check_alike_over(split, state.loss_group, "the data-parallel x context-parallel group")
    if state.loss_size == 1:
        return 0
    return average_gradients_over(trainable.values(), state.loss_group)


def saves_sharded_adapter(trainer: Any) -> bool:
    """Whether ``trainer`` trains a PEFT model whose weights are sharded: by transformers at
    load, or by FSDP with a sharded state dict (where the stock ``save_model`` writes
    nothing)."""
    if peft_patches.base_model(trainer.model) is not trainer.model and _sharded_at_load(trainer.model):
        return True
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        return False
    return peft_patches.base_model(trainer.model) is not trainer.model


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly FSDP2-sharded) parameter, on the CPU (collective for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def save_sharded_adapter(trainer: Any, output_dir: str) -> None:
    """Write the adapter of ``trainer.model`` (a ``PeftModel`` under FSDP2) to ``output_dir``.

    Call on every rank. The trainable parameters (the adapter's, and its
    ``modules_to_save`` copies) are gathered whole, in the same order on every rank; only the
    process that saves writes them (PEFT keeps the adapter's keys of the state dict given).
    """
    trainable = {name: _whole(p) for name, p in trainer.model.named_parameters() if p.requires_grad}
    if trainer.args.should_save:
        trainer.model.save_pretrained(output_dir, state_dict=trainable)
