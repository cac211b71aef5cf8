"""What a model computes along the sequence outside its attention function, handed the full
sequence's view under context parallelism.

Why: a rank holds a shard of the sequence, with its global ``position_ids``, and the ring
computes attention over the global positions; but some models read the sequence outside
the attention function, from what the forward holds:

- RoPE whose frequencies depend on the length ("dynamic" NTK, Phi-3's "longrope"):
  transformers' ``dynamic_rope_update`` picks them from ``max(position_ids) + 1``. The
  guard hands every such rotary module the batch's largest position id, gathered with the
  forward's validated header (``cp_inputs``), once per forward (:func:`hand_max_position`);
  the rotary then picks the frequencies the full sequence picks (on a packed row: the
  row's largest position, as transformers picks them for a packed row).
- Llama 4's attention temperature tuning scales the queries of its NoPE layers by their
  token's position numbered from 0 within the forward: the shard's. The ring rescales
  them to the position of each token in the full row (:func:`global_query_temperature`).
- Windows a model applies through its mask only (Qwen2-MoE, PhiMoE), and Llama 4's
  attention chunks (its mask too): read from the config and given to the ring as the
  layer's window and chunk (:func:`layer_window_and_chunk`), which it cuts its blocks to.

Which layers have a temperature, or a window or chunks of the mask, is read by model
support once per model (``support.detectors.handed_to_the_ring``) and travels in the
forward's :class:`ForwardContext`; the rotaries hold what the guard set for the forward.
Nothing here is a global. How transformers computes each of these is read through
``hf_ring.patches.transformers``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from hf_ring.hf.forward_context import ForwardContext
from hf_ring.hf.support.reading import text_stack
from hf_ring.patches.transformers import (
    hand_max_position as _hook_rotary,
    reads_max_position,
    set_max_position,
    temperature_scale,
)

# The base model's rotary modules that read the length, found once when it is guarded; in
# its own __dict__ so that copies of the model (deepcopy maps the modules) carry theirs.
_ROTARIES = "_hf_ring_length_rotaries"


def prepare(base: nn.Module) -> None:
    """Hook the rotary modules of ``base``'s text stack that pick their frequencies from the
    largest position (idempotent); called when the guard is installed."""
    rotaries = [m for m in text_stack(base).modules() if reads_max_position(m)]
    for m in rotaries:
        _hook_rotary(m)
    base.__dict__[_ROTARIES] = rotaries


def hand_max_position(base: nn.Module, max_position: Optional[int]) -> None:
    """Make ``base``'s length-dependent rotary modules pick their frequencies for this forward
    as if its largest position were ``max_position`` (the batch's, gathered across the CP
    group), or from the positions they are given (None: no CP)."""
    for m in base.__dict__.get(_ROTARIES, ()):
        set_max_position(m, max_position)


def layer_window_and_chunk(
    module: nn.Module, sliding_window: Optional[int], context: ForwardContext
) -> tuple[Optional[int], Optional[int]]:
    """The window and the attention chunk the ring applies in ``module``: the window it
    passes, else the one its model applies through the mask only, and the chunk its model
    applies through the mask (by ``layer_idx``); None where there is none."""
    layer = getattr(module, "layer_idx", None)
    window = sliding_window if sliding_window is not None else context.handed.windows.get(layer)
    return window, context.handed.chunks.get(layer)


def global_query_temperature(module: nn.Module, query: torch.Tensor, context: ForwardContext) -> torch.Tensor:
    """``query`` ``(batch, heads, seq_local, head_dim)`` with Llama 4's temperature at each
    token's global row position instead of its position within the shard (unchanged where
    the layer has no temperature tuning, or without CP: the forward then holds the row).

    The layer scaled each query by ``s(p_local)``; multiplying by ``s(p_global) / s(p_local)``
    (both >= 1) gives ``s(p_global)``, within float32 rounding, and its gradient."""
    found = context.handed.temperatures.get(getattr(module, "layer_idx", None))
    if found is None or context.state is None or context.token_index is None:
        return query
    key = (*found, query.shape[-2], query.device)
    ratio = context.cache.get(key)
    if ratio is None:
        local = torch.arange(query.shape[-2])
        ratio = temperature_scale(context.token_index, *found) / temperature_scale(local, *found)
        ratio = ratio.to(query.device).view(1, 1, -1, 1)  # (1, 1, seq_local, 1)
        context.cache[key] = ratio
    return (query * ratio).to(query.dtype)
