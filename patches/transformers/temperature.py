"""Llama 4's attention temperature tuning, as its attention layers compute it.

``Llama4TextAttention.forward`` scales the queries of its NoPE layers (``use_rope`` false,
``attn_temperature_tuning`` on) by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``
per token, where p numbers the tokens of the forward from 0 (5.24.0: ``torch.arange`` over
the forward's tokens, plus the cache's length; 4.57.6: ``cache_position``, which the model
sets to the same when it is not given), before it calls the attention function. Under
context parallelism those are the positions within this rank's shard, not the sequence's;
``query_temperature`` tells the attention function which scale the layer applied, so that
it can apply the sequence's instead.

Owns: ``query_temperature``, ``temperature_scale``. Must not import hf_ring.
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
from typing import Optional

import torch
import torch.nn as nn

from .versions import fail, installed_version, release_line

# How each release line's forward numbers the tokens and scales the queries (whitespace
# removed): the scale is the same formula; p differs in name only.
_NUMBERING = {
    "5": "positions=torch.arange(hidden_states.shape[1],device=hidden_states.device)+past_seen_tokens",
    "4.57": "ifself.attn_temperature_tuningandnotself.use_rope:attn_scales=",
}
_SCALE = {
    "5": "torch.log1p(torch.floor((positions.float()+1.0)/self.floor_scale))*self.attn_scale+1.0",
    "4.57": "torch.log1p(torch.floor((cache_position.float()+1.0)/self.floor_scale))*self.attn_scale+1.0",
}


@functools.lru_cache(maxsize=None)
def _scales_as_written(cls: type, version: str) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return False
    flat = re.sub(r"\s+", "", source)
    line = release_line(version)
    return _NUMBERING[line] in flat and _SCALE[line] in flat and "query_states=(query_states*attn_scales)" in flat


def query_temperature(module: nn.Module) -> Optional[tuple[float, float]]:
    """``(floor_scale, attn_scale)`` when ``module`` scales its queries by Llama 4's
    temperature, numbering the forward's tokens from 0; None when it does not scale them.

    Raises:
        UnsupportedTransformersVersion: an unsupported transformers version, or a module
            with temperature tuning on whose forward computes it another way.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    version = installed_version()
    if not _scales_as_written(type(module), version):
        raise fail(f"{type(module).__name__}.forward does not compute Llama 4's attention temperature as "
                   "it was read", version)
    return float(module.floor_scale), float(module.attn_scale)


def temperature_scale(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """The scale of each query at ``positions`` (int ``(n,)``), float32 ``(n,)``, computed
    exactly as the layer computes it."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
