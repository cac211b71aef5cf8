"""A model in float64 through its gated delta rule layers: the one-process reference of the
checks that float32 cannot settle (Qwen3.5 image-text, tests/test_cp_vlm_hybrid.py and the
multimodal sweep).

Why: transformers' ``torch_chunk_gated_delta_rule`` computes in float32 whatever its inputs'
dtype, so a model cast to float64 still rounds its recurrence to float32, and the gradients
of its decay parameters (``linear_attn.A_log``, ``dt_bias``: a few entries, sums over every
token that nearly cancel) stay ~1e-3 to 2e-2 relative from exact whichever side runs it
(measured on the tiny Qwen3.5 image-text model, one process: float32 against float64, or
float32 chunks of 64 against chunks of 16). hf_ring's one-process scan
(``local_gated_delta_rule``) computes in its inputs' dtype; put in the modeling module's
place for the reference's forward and backward, it makes the reference float64 through the
recurrence. What the model's own code casts to float32 (its RMSNorms, rotary tables, the
vision rotary) stays float32 on both sides: float64 checks hold to ~2e-7, not 1e-15.

Works in a spawned rank of a gloo world too: the scan takes no process group. Must not
import hf_ring's integration or training layers.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from hf_ring.mixers.delta_rule_chunk import local_gated_delta_rule

NAME = "torch_chunk_gated_delta_rule"


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype``; float64 MoE experts on the eager path (``grouped_mm`` takes no float64)."""
    if dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.to(dtype)


def cast_floats(batch: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``batch`` with its floating-point tensors (pixel values) in ``dtype``."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def _scan(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
          use_qk_l2norm_in_kernel=False, **kwargs):
    """``torch_chunk_gated_delta_rule``'s signature: q, k ``(batch, seq, hk, dk)``, v ``(batch,
    seq, hv, dv)``, g, beta ``(batch, seq, hv)``; out in q's dtype, computed in it."""
    out, final = local_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state, use_qk_l2norm_in_kernel)
    return out, final if output_final_state else None


@contextmanager
def float64_delta_rule(model: torch.nn.Module) -> Iterator[None]:
    """While open, ``model``'s modeling modules run hf_ring's one-process scan in place of
    transformers' float32 one (the modules are shared: open it for the reference only)."""
    modules = {importlib.import_module(type(m).__module__) for m in model.modules()}
    saved = {m: vars(m)[NAME] for m in modules if NAME in vars(m)}
    assert saved, f"{type(model).__name__} has no {NAME}: nothing to run in float64"
    for module in saved:
        setattr(module, NAME, _scan)
    try:
        yield
    finally:
        for module, original in saved.items():
            setattr(module, NAME, original)
