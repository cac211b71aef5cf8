"""One dtype for an attention call's q, k, v, as the attention functions we stand in for
(SDPA, transformers' flash-attention path) settle it: the block kernels take one dtype.

Under autocast the projections come out in mixed dtypes (q and k in float32 after RoPE,
v in the autocast dtype), and SDPA runs in autocast's dtype whatever its inputs' dtypes:
all three are cast to it. Outside autocast they must already share one dtype.
"""

from __future__ import annotations

import torch


def one_dtype(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (any shapes, one device) in one float dtype: autocast's when it is on."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
        return query.to(target), key.to(target), value.to(target)
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"attention got q, k, v in {query.dtype}, {key.dtype}, {value.dtype} outside autocast; "
            "cast the model to one dtype (model.to(dtype)) or run it under torch.autocast"
        )
    return query, key, value
