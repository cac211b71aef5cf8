"""Pipeline stages cut from a Hugging Face causal LM, each run through the model's own forward.

Why through the model's own forward: everything hf_ring checks and hands down under context
parallelism happens there. The ring guard sits on the base model (``LlamaModel``), validates
each forward's inputs over the CP group and hands the attention layers their context; the
base model computes the rotary embeddings from ``position_ids`` and builds its masks; the
causal LM applies what it does to the head's output (softcapping, scaling). A stage
therefore is a *view* of the model: a new module object that shares the model's parameters,
buffers and hooks, whose decoder-layer list holds this stage's layers and a
:class:`SkippedLayer` in every other slot (layer indices, and the per-layer types read by
index, stay the model's). The first stage embeds ``input_ids``; every later stage enters the
base model with ``inputs_embeds`` (the previous stage's hidden states); only the last stage
keeps the final norm and the head and returns logits. Each stage runs the base model's
forward, so the guard checks every stage's attention layers and nothing else, and rotary
embeddings are computed on every stage from the global ``position_ids``.

The model itself is pruned to the layers of this rank's stages (the others' weights are
dropped), so the optimizer, the gradient clipping and the saving see this rank's parameters
under the model's own names (``model.layers.5.mlp.up_proj.weight``).

Must not import accelerate, TRL, or hf_ring's training layer (but its loss arithmetic).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn as nn

from hf_ring.pipeline.refusals import check_pipeline_model


class SkippedLayer(nn.Module):
    """A module another stage holds: passes its first input on unchanged, owns no weight."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


def _view(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s parameters, buffers and hooks, with a child
    table of its own (so its children can be replaced without touching ``module``)."""
    view = copy.copy(module)
    view.__dict__["_modules"] = dict(module._modules)
    return view


def _child_name(parent: nn.Module, child: nn.Module, which: str = "input") -> str:
    for name, module in parent._modules.items():
        if module is child:
            return name
    raise NotImplementedError(
        f"{type(parent).__name__}'s {which} embedding is not one of its own modules, so hf_ring cannot place it on "
        f"the {'first' if which == 'input' else 'last'} pipeline stage; this model is not supported under pipeline "
        "parallelism")


class StageModule(nn.Module):
    """One pipeline stage: ``forward(x, position_ids, doc_bounds=None)``.

    Args of ``forward``:
        x: the first stage's ``input_ids`` int64 ``(rows, local_seq)``; a later stage's input
            hidden states ``(rows, local_seq, hidden)``.
        position_ids: int64 ``(rows, local_seq)``, the global positions of this CP shard.
        doc_bounds: packed rows only: int ``(1, max_docs + 1)``, the row's global document
            bounds, padded with -1 (``hf_ring.pipeline.microbatches``).

    Returns the hidden states ``(rows, local_seq, hidden)``, or on the last stage the logits
    ``(rows, local_seq, vocab)``.
    """

    def __init__(self, lm: nn.Module, stage_index: int, num_stages: int):
        super().__init__()
        self.lm = lm
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                doc_bounds: Optional[torch.Tensor] = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"position_ids": position_ids, "use_cache": False}
        if doc_bounds is not None:
            bounds = doc_bounds.reshape(-1)
            bounds = bounds[bounds >= 0].to(torch.int32)
            longest = int((bounds[1:] - bounds[:-1]).max())
            kwargs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds.clone(), max_length_q=longest,
                          max_length_k=longest)
        entry = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        if self.is_last:
            return self.lm(**entry, **kwargs).logits
        return self.lm.base_model(**entry, **kwargs).last_hidden_state


def build_stage_modules(model: nn.Module, stage_ids: list[int],
                        ranges: list[tuple[int, int]]) -> dict[int, StageModule]:
    """This rank's stages of ``model`` (a causal LM), by stage index; prunes ``model`` to them.

    Args:
        model: the causal LM (``LlamaForCausalLM``, ...), checked by
            :func:`hf_ring.pipeline.refusals.check_pipeline_model`.
        stage_ids: the stage indices this rank holds (``split.stages_of_rank``).
        ranges: every stage's ``[start, end)`` decoder layers (``split.stage_layer_ranges``).
    """
    check_pipeline_model(model)
    num_stages = len(ranges)
    base = model.base_model
    layers = base.layers
    owned = {i for s in stage_ids for i in range(*ranges[s])}
    for i in range(len(layers)):
        if i not in owned:
            layers[i] = SkippedLayer()
    embed_name = _child_name(base, base.get_input_embeddings())
    head_name = _child_name(model, model.get_output_embeddings(), "output")
    if 0 not in stage_ids:
        setattr(base, embed_name, SkippedLayer())
    if num_stages - 1 not in stage_ids:
        base.norm = SkippedLayer()
        setattr(model, head_name, SkippedLayer())
    stages = {}
    for s in stage_ids:
        start, end = ranges[s]
        base_view = _view(base)
        base_view.__dict__["_modules"]["layers"] = nn.ModuleList(
            [layers[i] if start <= i < end else SkippedLayer() for i in range(len(layers))])
        if s != 0:
            base_view.__dict__["_modules"][embed_name] = SkippedLayer()
        lm_view = _view(model)
        if s != num_stages - 1:  # a stage's module tree holds its own weights only (FSDP2 shards each stage's)
            base_view.__dict__["_modules"]["norm"] = SkippedLayer()
            lm_view.__dict__["_modules"][head_name] = SkippedLayer()
        lm_view.__dict__["_modules"][model.base_model_prefix] = base_view
        stages[s] = StageModule(lm_view, s, num_stages)
    return stages


__all__ = ["SkippedLayer", "StageModule", "build_stage_modules"]
