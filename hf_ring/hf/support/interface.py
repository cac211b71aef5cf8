"""Detector: attention that does not go through transformers' attention interface, so would
never call ``ring_flash``: an attention class picked from a table keyed by implementation
name (Falcon's ``FALCON_ATTENTION_CLASSES``, GPT-Neo's: ``KeyError: 'ring_flash'`` while
the layers are built), or attention classes from a modeling module that runs its own eager
or SDPA code (Bloom, MPT, ...). Refused when a model asks for ``ring_flash``.

How a modeling module is written is read through ``hf_ring.patches.transformers`` (it is
transformers' implementation detail). Owns: ``class_table`` (from the model's class
alone), ``bypassing_modules`` (from the built modules). Must not import: Trainer, TRL,
hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from hf_ring.hf.support.reading import RING_FLASH, attention_modules, listed, text_stack
from hf_ring.patches.transformers import attention_class_tables, uses_attention_interface


def class_table(model: nn.Module) -> Optional[str]:
    """The refusal of a model whose modeling module picks its attention class from a table
    without a ``ring_flash`` entry, or None. Reads the model's class only (runs at the end of
    ``PreTrainedModel.__init__``, before the layers are built)."""
    for name, table in attention_class_tables(type(model)).items():
        if RING_FLASH not in table:
            return (
                f"{type(model).__name__} picks its attention class from {name} by "
                f"attention implementation (it has {sorted(table)}), not through transformers' attention "
                f"interface, so it cannot run attn_implementation={RING_FLASH!r} (with or without context "
                "parallelism); use attn_implementation='sdpa' or 'eager' without context parallelism"
            )
    return None


def bypassing_modules(model: nn.Module) -> Optional[str]:
    """The refusal of a model whose attention modules come from a modeling module that does
    not dispatch through the attention interface, or None. Needs the built modules."""
    bypassing = [
        f"{path} ({type(m).__name__})"
        for path, m in attention_modules(list(text_stack(model).named_modules()))
        if not uses_attention_interface(type(m))
    ]
    if not bypassing:
        return None
    return (
        f"{type(model).__name__}'s attention modules {listed(bypassing)} do not go through "
        f"transformers' attention interface, so they would never call {RING_FLASH!r} (they run "
        "their own attention code); this model is not supported by hf_ring: use "
        "attn_implementation='sdpa' or 'eager' without context parallelism"
    )
