"""The positions a Qwen-VL base model computes for itself, read through its own method.

Why here: ``Qwen2VLModel`` / ``Qwen2_5_VLModel`` / ``Qwen3VLModel`` (and the MoE variant) of
transformers 5.x number their tokens in ``compute_3d_position_ids``, a method the forward
calls when it is given no ``position_ids``; it is no documented API (its arguments changed
within 5.x, Qwen2.5-VL's takes ``second_per_grid_ts``, the others' do not) and it writes
the model's ``rope_deltas`` (what generation continues from). hf_ring calls it per packed
document, so that each document gets exactly the positions the model gives it alone; the
call binds only the arguments this release's method takes, and leaves ``rope_deltas`` as
it found it.

Owns: ``own_position_ids``. Imports nothing of transformers itself (it is handed the model).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

import torch

from .versions import fail, installed_version

# What 5.24.0's compute_3d_position_ids takes in every Qwen-VL family.
_REQUIRED = ("input_ids", "inputs_embeds", "image_grid_thw", "video_grid_thw", "attention_mask", "cache",
             "mm_token_type_ids")


def own_position_ids(base: Any, sample: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """What ``base.forward`` would compute as ``position_ids`` for ``sample`` alone, with no
    cache and no padding mask: int64 ``(3, 1, n)`` M-RoPE positions, or None where the model
    leaves the numbering to its language model (no grids, or no ``mm_token_type_ids``).

    Args:
        base: a Qwen-VL base model (``Qwen2_5_VLModel``, ...).
        sample: one sample's processor outputs: ``input_ids`` int ``(1, n)``, and as given
            ``mm_token_type_ids`` int ``(1, n)``, ``image_grid_thw`` / ``video_grid_thw`` int
            ``(n_images or n_videos, 3)``, ``second_per_grid_ts`` float ``(n_videos,)``.

    Raises:
        UnsupportedTransformersVersion: the model has no ``compute_3d_position_ids`` taking
            the arguments transformers 5.24.0's takes.
    """
    version = installed_version()
    method = getattr(base, "compute_3d_position_ids", None)
    if not callable(method):
        raise fail(f"{type(base).__name__} has no compute_3d_position_ids", version)
    parameters = inspect.signature(method).parameters
    missing = [n for n in _REQUIRED if n not in parameters]
    if missing:
        raise fail(f"{type(base).__name__}.compute_3d_position_ids takes no {', '.join(missing)}", version)
    if not hasattr(base, "rope_deltas"):
        raise fail(f"{type(base).__name__} holds no rope_deltas", version)
    given = {n: sample.get(n) for n, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD}
    kept = base.rope_deltas
    try:
        return method(**{**given, "inputs_embeds": None, "attention_mask": None, "cache": None})
    finally:
        base.rope_deltas = kept
