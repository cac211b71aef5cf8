"""Detector: attention that does not go through transformers' attention interface, so would
never call ``ring_flash``: an attention class picked from a table keyed by implementation
name (Falcon's ``FALCON_ATTENTION_CLASSES``, GPT-Neo's: ``KeyError: 'ring_flash'`` while
the layers are built), or attention classes from a modeling module that runs its own eager
or SDPA code (Bloom, MPT, ...). Refused when a model asks for ``ring_flash``. And attention
that goes through the interface but never receives the forward's keyword arguments, where
the guard's validated context travels (Falcon on transformers 5.25: its base model and
decoder layers take ``**kwargs`` and drop them): refused under CP and on packed rows, where
the ring needs that context; without them ``ring_flash`` is SDPA and needs none.

How a modeling module is written is read through ``hf_ring.patches.transformers`` (it is
transformers' implementation detail). Owns: ``class_table`` (from the model's class
alone), ``bypassing_modules`` (from the built modules), ``dropped_keywords`` (under CP).
Must not import: Trainer, TRL, hf_ring's training or memory layers.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch.nn as nn

from hf_ring.hf.support.reading import RING_FLASH, Modules, attention_modules, listed, text_stack
from hf_ring.patches.transformers import (attention_class_tables, forward_reads_keywords, release_line,
                                          uses_attention_interface)


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


def _carriers(modules: Modules) -> list[nn.Module]:
    """The modules whose forwards carry a forward's keyword arguments from the text stack's
    root down to its attention modules: the root, and every module between it and an
    attention module (torch's containers, which have no forward of their own, left out)."""
    by_path = dict(modules)
    paths: set[str] = set()
    for path, _ in attention_modules(modules):
        parts = path.split(".")
        paths |= {".".join(parts[:i]) for i in range(len(parts))}  # the root ("") included
    found = [by_path[p] for p in sorted(paths, key=lambda p: (p.count("."), p)) if p in by_path]
    return [m for m in found if not type(m).__module__.startswith("torch.")]


def dropped_keywords(config: Any, modules: Modules) -> Iterator[str]:
    """One refusal (formatted with ``{where}``) naming the classes on the way to the
    attention modules whose forwards take ``**kwargs`` and drop them (or take none below the
    root), so the guard's context never reaches the ring. Read on transformers 5 only: its
    forwards hand ``**kwargs`` down by name, which is what the reading checks; 4.57's MoE
    forwards hand them on under other names (Qwen2-MoE, PhiMoE were read as dropping them
    while they run exactly under CP: the oldest leg's tests)."""
    import transformers

    if release_line(transformers.__version__) != "5":
        return
    dropping = list(dict.fromkeys(
        f"{type(m).__name__}.forward" for m in _carriers(modules) if forward_reads_keywords(type(m)) is False
    ))
    if dropping:
        yield (
            f"the forward's keyword arguments stop at {listed(dropping)}: each takes **kwargs (or none) and "
            "never passes them on to the attention layers below it, so the context hf_ring validates once per "
            "forward never reaches ring_flash, which needs it {where}; this model runs ring_flash only "
            "without context parallelism and without packing (where it is SDPA)"
        )

