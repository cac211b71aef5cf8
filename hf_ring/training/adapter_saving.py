"""Saving a PEFT adapter whose weights FSDP2 shards.

The stock ``Trainer.save_model`` under FSDP writes the model only with a
``FULL_STATE_DICT``; with ``SHARDED_STATE_DICT`` (what
:func:`hf_ring.training.weight_sharding.fsdp_training_arguments` sets, so that checkpoints
stay sharded) it writes nothing and says nothing, and a LoRA run under FSDP2 ends with no
adapter on disk. An adapter is small: its trainable weights are gathered whole (every
rank takes part: ``DTensor.full_tensor`` is a collective) and the process that saves
writes them with PEFT's own ``save_pretrained``, as ``adapter_model.safetensors`` that
loads into a plain model with ``PeftModel.from_pretrained``.

Must not import TRL.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_ring.patches import peft as peft_patches


def saves_sharded_adapter(trainer: Any) -> bool:
    """Whether ``trainer`` trains a PEFT model whose weights FSDP shards with a sharded state
    dict (where the stock ``save_model`` writes nothing)."""
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
