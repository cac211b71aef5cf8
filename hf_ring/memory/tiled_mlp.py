"""The decoder layers' MLP computed in tiles of tokens, each tile recomputed in backward.

Why: a Llama MLP holds ``tokens x intermediate_size`` three times (gate, up, their product)
for its backward, and its forward builds them all at once: at 14,336 intermediate and 512K
tokens per device that is 44 GB per layer in bfloat16, the largest transient of a
checkpointed layer. Computed ``tile_tokens`` tokens at a time, each tile under a
non-reentrant checkpoint, the MLP holds only its input (a view) and its output, and one
tile's intermediates at a time in the forward and in the backward.

Exact: a dense MLP is applied to each token on its own, so a tile computes the same rows
(the weight gradient is summed over tiles instead of in one matmul: a few ulps). A module
that mixes tokens (mixture-of-experts routing with capacity or load-balancing statistics,
a convolution) cannot be tiled this way and is refused. Under DeepSpeed ZeRO-3 every rank
runs as many tiles as the rank with the most (empty ones where it has fewer), since each
tile's Linear calls gather their weights across the ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_TILED = "_hf_ring_tiled_mlp"
# Modules an MLP made of per-token dense maps may contain besides nn.Linear (parameter-free
# activations); anything with parameters of its own, or a list of experts, is refused.
_MIXING_WORDS = ("moe", "expert", "router", "sparse", "conv")


def check_dense_mlp(name: str, mlp: nn.Module, feature: str = "tiled MLP",
                    remedy: str = "drop the tiled-MLP option") -> None:
    """Refuse an ``mlp`` that is not made of per-token linear maps and activations, for
    ``feature`` (which computes such an MLP on any subset of the tokens), naming ``name``
    and ``remedy``."""
    for sub_name, sub in mlp.named_modules():
        label = f"{name}.{sub_name}" if sub_name else name
        lowered = f"{type(sub).__name__} {sub_name}".lower()
        if any(word in lowered for word in _MIXING_WORDS) or isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            raise NotImplementedError(
                f"{feature}: {label} ({type(sub).__name__}) looks like a mixture of experts or a module that "
                f"mixes tokens, which cannot be computed on a part of the tokens exactly; {remedy}"
            )
        if not isinstance(sub, nn.Linear) and any(True for _ in sub.parameters(recurse=False)):
            raise NotImplementedError(
                f"{feature}: {label} ({type(sub).__name__}) has parameters but is not an nn.Linear; hf_ring "
                f"takes only MLPs made of linear maps and activations; {remedy}"
            )


def _tiled_forward(mlp: nn.Module, forward: Any, tile_tokens: int, hidden: torch.Tensor, *args: Any, **kwargs: Any):
    """``forward(hidden)`` computed over tiles of ``tile_tokens`` tokens of dim -2.

    ``hidden``: ``(..., tokens, hidden_size)``, any float dtype.
    """
    if args or kwargs:
        raise NotImplementedError(
            f"tiled MLP: {type(mlp).__name__} was called with more than the hidden states; drop the tiled-MLP option"
        )
    tiles = list(hidden.split(tile_tokens, dim=-2))
    count = _tile_count(mlp, len(tiles), hidden.device)
    if count == 1:
        return forward(hidden)
    # Empty tiles bring a rank up to the group's count (they compute nothing, and gather and
    # release ZeRO-3's weights as a tile does, in the forward and in the recompute).
    tiles += [hidden.narrow(-2, 0, 0)] * (count - len(tiles))
    if not torch.is_grad_enabled():  # nothing is kept for a backward: no need to recompute
        return torch.cat([forward(t) for t in tiles], dim=-2)
    return torch.cat([checkpoint(forward, t, use_reentrant=False) for t in tiles], dim=-2)


def _tile_count(mlp: nn.Module, tiles: int, device: torch.device) -> int:
    """How many tiles this call runs: its own ``tiles``, or under DeepSpeed ZeRO-3 the most
    any rank of the partition group has. Each Linear call of a ZeRO-3 model gathers its
    weight over that group, so ranks whose rows differ in length (data-parallel batches,
    rows placed by length) must call the MLP's layers equally often, or the gathers
    mismatch (gloo aborts, NCCL hangs). One all-reduce of an int per MLP call, ZeRO-3 only."""
    param = next((p for p in mlp.parameters() if hasattr(p, "ds_id")), None)
    if param is None or not (dist.is_available() and dist.is_initialized()):
        return tiles
    count = torch.tensor([tiles], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=getattr(param, "ds_process_group", None))
    return int(count.item())


def tile_mlps(model: nn.Module, tile_tokens: int = 2048) -> int:
    """Compute every decoder layer's ``mlp`` in tiles of ``tile_tokens`` tokens.

    Called again on the same model, the MLPs are tiled by the new ``tile_tokens`` (the old
    size is dropped, not nested).

    Args:
        model: a transformers causal LM or base model whose decoder layers (``get_decoder().layers``
            or ``.layers``) each have an ``mlp``.
        tile_tokens: tokens per tile.

    Returns:
        The number of MLPs tiled.

    Raises:
        NotImplementedError: a model without such layers, or an MLP that is not dense.
    """
    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive int, not {tile_tokens!r}")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    mlps = [(f"layers.{i}.mlp", getattr(layer, "mlp", None)) for i, layer in enumerate(layers or [])]
    if not mlps or any(m is None for _, m in mlps):
        raise NotImplementedError(
            f"tiled MLP: {type(model).__name__} has no decoder layers with an 'mlp' module; drop the tiled-MLP option"
        )
    for name, mlp in mlps:
        check_dense_mlp(name, mlp)
    for _, mlp in mlps:
        # A tiled MLP's forward is ours: replaced again (never wrapped), so a second call
        # tiles by its own size, once.
        if "forward" in vars(mlp) and not mlp.__dict__.get(_TILED):
            raise NotImplementedError(
                f"tiled MLP: {type(mlp).__name__}.forward is already replaced on the instance by something else, "
                "which tiling would drop; remove that replacement first or drop the tiled-MLP option"
            )
        # The class's forward bound to the module: hooks on the MLP still run once per call.
        mlp.forward = functools.partial(_tiled_forward, mlp, type(mlp).forward.__get__(mlp), tile_tokens)
        mlp.__dict__[_TILED] = True
    return len(mlps)
