"""The mask builder registered with transformers' ``AttentionMaskInterface`` for
``ring_flash``.

Why it exists: transformers builds no mask at all for an attention implementation that
has no mask builder registered, and ``ring_flash`` must stay exact local attention without
context parallelism, padding included. So without CP it builds exactly the mask SDPA gets
(the same registered builder, called with the same arguments), except on a multimodal
packed row (Gemma 3's): there every ``ring_flash`` layer runs the varlen ring, which ignores
the mask (``hf_ring.hf.attention``), and a ``(batch, 1, seq, seq)`` mask would be wasted
memory quadratic in the row's length. Under CP it builds none:
the ring computes the causal mask from the global positions itself, and the only padding
it accepts, right padding, was validated for the forward by the guard
(``hf_ring.hf.cp_inputs``) and needs no mask under causal attention.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from hf_ring.hf.multimodal.shard import packed_without_cp
from hf_ring.patterns.state import get_context_parallel_state


def ring_flash_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """Takes whatever transformers passes its mask builders (the arguments differ between
    releases: ``cache_position`` in 4.57, ``q_length`` / ``q_offset`` in 5.x) and returns
    SDPA's mask ``(batch, 1, q_len, kv_len)`` (bool) or None without CP; None under CP and
    on a multimodal packed row, whose varlen ring reads no mask."""
    state = get_context_parallel_state()
    if state is None or state.cp_size == 1:
        if packed_without_cp():
            return None
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
    return None
