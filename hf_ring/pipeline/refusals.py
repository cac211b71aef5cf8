"""What pipeline stages are not built for yet, refused by name before any stage exists.

Why its own module: every rank builds its stages from the same model and calls this with
it, so a refusal is raised on every rank alike (none waits for a peer in a send that never
comes), and the list of what is not composed stays in one place that docs/parallelism.md
cites.

Refused: a model whose base model does not hold its decoder layers as ``layers``, its final
norm as ``norm`` and its input embedding as a child (image-text models and other layouts);
tied input and output embeddings (the first and the last stage would each train a copy);
token mixers that hf_ring routes (hybrid models: their states cross the sequence, not yet
the stages); the MoE router's load-balancing loss (it sums over every layer, which the
stages hold apart); a model sharded for expert parallelism at load.

Must not import accelerate, TRL, or hf_ring's training layer.
"""

from __future__ import annotations

import torch.nn as nn


def _refuse(model: nn.Module, what: str, todo: str) -> None:
    raise NotImplementedError(f"pipeline parallelism (pp_size > 1) for {type(model).__name__}: {what} is not composed "
                              f"with pipeline stages yet; {todo}")


def check_pipeline_model(model: nn.Module) -> None:
    """Raise NotImplementedError for a causal LM hf_ring cannot cut into pipeline stages."""
    from hf_ring.patches.transformers.mixers import is_routed_layer  # transformers: only where a model is cut

    base = getattr(model, "base_model", None)
    config = getattr(model, "config", None)
    if base is None or base is model or config is None or not isinstance(getattr(model, "lm_head", None), nn.Module):
        _refuse(model, "a model without a causal LM head around a base model", "pass a *ForCausalLM model")
    if getattr(config, "vision_config", None) is not None or getattr(base, "language_model", None) is not None:
        _refuse(model, "an image-text model", "train it with pp_size=1 (context parallelism alone composes with it)")
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(getattr(base, "norm", None), nn.Module) \
            or base.get_input_embeddings() is None:
        _refuse(model, f"a base model ({type(base).__name__}) that does not hold its decoder layers as `layers`, its "
                "final norm as `norm` and an input embedding", "train it with pp_size=1")
    if getattr(config, "tie_word_embeddings", False) or (
            getattr(model.lm_head, "weight", None) is not None
            and model.lm_head.weight is getattr(base.get_input_embeddings(), "weight", None)):
        _refuse(model, "tied input and output embeddings (the first and last stages would train two copies)",
                "build the model with tie_word_embeddings=False, or train with pp_size=1")
    routed = [name for name, m in model.named_modules() if is_routed_layer(m)]
    if routed:
        _refuse(model, f"hybrid token mixers ({', '.join(routed[:3])}{', ...' if len(routed) > 3 else ''})",
                "train the hybrid model with pp_size=1")
    if getattr(config, "output_router_logits", False):
        _refuse(model, "the MoE router's load-balancing loss (output_router_logits=True: a sum over every layer)",
                "set config.output_router_logits=False, or train with pp_size=1")
    distributed = getattr(config, "distributed_config", None)
    if distributed is not None and (getattr(distributed, "ep_size", 1) or 1) > 1:
        _refuse(model, f"expert parallelism (DistributedConfig(ep_size={distributed.ep_size}))",
                "load the model without ep_size, or train with pp_size=1")


__all__ = ["check_pipeline_model"]
