"""The random ops a CP forward can meet, by how hf_ring treats them, and what the refusals
of a draw say (the op, the model code that called it, what to set to 0).

Part of the transformers integration; uses no transformers API. Must not import the Trainer,
TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

import inspect
import traceback
from typing import Callable

import torch
import torch.nn.functional as F

# What to set to 0 for a draw hf_ring refuses (the message names the op and its caller).
WHAT_TO_DO = (
    "set that probability or noise to 0 in the model's config (the module's dropout, e.g. "
    "hidden_dropout / resid_pdrop / embd_pdrop / lora_dropout, or router_jitter_noise / "
    "input_jitter_noise), or train it without context parallelism"
)


def dropout_flags(func: Callable, args: tuple, kwargs: dict) -> tuple[torch.Tensor, float, bool, bool]:
    """``(input, p, training, inplace)`` of a dropout call: ``F.dropout(input, p=0.5,
    training=True, inplace=False)`` or ``torch.dropout(input, p, train)``."""
    if func is torch.dropout:
        bound = dict(zip(("input", "p", "train"), args), **kwargs)
        return bound["input"], float(bound["p"]), bool(bound["train"]), False
    bound = inspect.signature(F.dropout).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return a["input"], float(a["p"]), bool(a["training"]), bool(a["inplace"])


# Random ops that act on the tensor they are called on (drawn in full, then copied in).
FILLS = frozenset({
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_, torch.Tensor.bernoulli_,
})
# Random ops that make a new tensor like their first argument (drawn in full, then sliced).
LIKES = frozenset({torch.rand_like, torch.randn_like, torch.randint_like})
# Random ops made from a size (drawn in full when the size has the sequence axis).
SIZED = frozenset({torch.rand, torch.randn})
DROPOUTS = frozenset({F.dropout, torch.dropout})
# Random ops hf_ring does not draw on the full sequence: refused when a tensor they read or
# make has the sequence axis (a per-token probability, channel dropout, a permutation).
REFUSED = frozenset({
    torch.bernoulli, torch.Tensor.bernoulli, torch.multinomial, torch.Tensor.multinomial, torch.normal,
    torch.poisson, torch.randint, torch.randperm, torch.binomial, torch.alpha_dropout,
    torch.feature_dropout, torch.feature_alpha_dropout, torch.native_dropout, torch.dropout_,
    torch.rrelu, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    F.gumbel_softmax, F.rrelu,
})
# Calls among REFUSED that draw nothing with these keyword values (eval-mode dropout).
DRAWS_ONLY_IF = {F.dropout1d: "training", F.dropout2d: "training", F.dropout3d: "training",
                  F.alpha_dropout: "training", F.feature_alpha_dropout: "training", F.rrelu: "training"}


def op_name(func: Callable) -> str:
    owner = "torch.Tensor." if getattr(func, "__objclass__", None) is torch._C.TensorBase else ""
    module = getattr(func, "__module__", None) or "torch"
    return owner + func.__name__ if owner else f"{module}.{func.__name__}"


def caller() -> str:
    """The innermost frame outside torch and this file: the model code that drew."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/hf_ring/hf/randomness/" not in path:
            return f"{path.rsplit('/site-packages/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"


# Every op above: what a mode that refuses all draws must see.
RANDOM_OPS = DROPOUTS | FILLS | LIKES | SIZED | REFUSED
