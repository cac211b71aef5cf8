"""What ``ring_flash`` refuses in one attention call, naming the layer and what to do: the
features of the call it does not compute (dropout, keywords such as a sparse indexer's
``indices``, non-causal attention, a KV cache hf_ring did not prepare under the ring,
softcapping on packed rows), and a call under context parallelism without the validated
context the guard hands down.

Owns the refusals; the attention function (attention.py) calls them. Must not import the
Trainer, TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from hf_ring.hf.support import RING_FLASH
from hf_ring.patterns.state import get_context_parallel_state


def layer_name(module: nn.Module) -> str:
    layer = getattr(module, "layer_idx", None)
    return type(module).__name__ + (f" (layer {layer})" if layer is not None else "")


def refuse_dropout(module: nn.Module, dropout: float) -> None:
    if dropout > 0:
        raise NotImplementedError(
            f"{layer_name(module)} asks for attention dropout {dropout} in training, which ring_flash does "
            "not compute under context parallelism, on packed rows, or with sinks or softcapping: it drops "
            "entries of the (query x key) probabilities, which the ring never forms (it merges blocks through "
            "their log-sum-exp), and a kernel's own dropout would draw another mask for each block and each "
            "cp. Set the config's attention dropout to 0.0 (attention_dropout, attn_pdrop or "
            "attention_probs_dropout_prob by family); hidden, residual and embedding dropout are computed"
        )


def refuse_softcap_on_packed(module: nn.Module, softcap: Optional[float]) -> None:
    if softcap is not None:
        raise NotImplementedError(
            f"{layer_name(module)} uses attention logit softcapping (softcap={softcap}, e.g. Gemma 2's "
            "attn_logit_softcapping), which ring_flash computes on dense rows (with and without "
            "context parallelism) but not on packed rows; use dense rows (no packing)"
        )


# Attention-function keywords that change what attention computes and that ring_flash does
# not compute: refused rather than ignored (ignoring one is a silently different model).
UNCOMPUTED_KWARGS = {
    "indices": "sparse attention over top-k selected keys (a DeepSeek-V3.2-style indexer)",
    "position_bias": "a relative position bias added to the scores",
    "attn_bias": "a bias added to the scores",
    "alibi": "ALiBi position biases",
    "sinks": "attention sinks passed under another name than s_aux",
}


def refuse_uncomputed(module: nn.Module, kwargs: dict[str, Any]) -> None:
    for name, what in UNCOMPUTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{layer_name(module)} passes {name}= to its attention function: {what}, which ring_flash "
                "does not compute; use the attention implementation the model documents (e.g. "
                "'eager') without context parallelism"
            )


def is_causal(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    is_causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)


def refuse_under_ring(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any], what: str,
    causal_by_mask: bool = False,
) -> None:
    """``causal_by_mask``: the layer is flagged non-causal but the model's own mask makes it
    causal plus bidirectional spans, which the forward's plan computes (PaliGemma)."""
    if not is_causal(module, kwargs) and not causal_by_mask:
        raise NotImplementedError(
            f"{layer_name(module)} runs non-causal attention, but {what} computes causal self-attention "
            "only (a decoder's); encoders and cross-attention are not supported"
        )
    if key.shape[-2] != query.shape[-2]:
        raise NotImplementedError(
            f"{layer_name(module)} got {key.shape[-2]} keys for {query.shape[-2]} queries: a KV cache that "
            f"hf_ring's generation hooks did not prepare is not supported by {what}; pass use_cache=False, "
            "or generate as docs/generation.md says"
        )


def refuse_without_context(module: nn.Module) -> None:
    """Under context parallelism the ring needs the forward's validated context; without
    it this layer would attend within its own shard only."""
    state = get_context_parallel_state()
    if state is not None and state.cp_size > 1:
        raise RuntimeError(
            f"ring_flash ran under context parallelism (cp_size={state.cp_size}) in {layer_name(module)} "
            "without the context that hf_ring's model guard validates once per forward: either the "
            f"model is not guarded (create it with attn_implementation={RING_FLASH!r} after `import "
            "hf_ring`, or call hf_ring.hf.attention.guard_model(model)), or this model does not hand "
            "its forward's keyword arguments to its attention layers, which hf_ring needs; such a "
            "model is not supported under context parallelism"
        )
