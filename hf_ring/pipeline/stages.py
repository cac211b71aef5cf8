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
keeps the final norm and the head and returns logits, or, with the chunked loss, the
micro-batch's float32 token-loss sum computed inside the head's call
(``hf_ring.memory.chunked_loss.model_token_loss_sum``: no ``tokens x vocab`` logits; under
FSDP2 inside the stage the head's weight is whole only there). Each stage runs the base model's
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

from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
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
    """One pipeline stage: ``forward(x, position_ids, doc_bounds=None, shift_labels=None)``.

    Args:
        lm: this stage's view of the causal LM (:func:`build_stage_modules`).
        stage_index, num_stages: its place in the pipeline.
        chunked_loss: the last stage only: compute the loss by chunks inside the head's call
            and return its float32 token-loss sum instead of the logits (None: the logits).

    Args of ``forward``:
        x: the first stage's ``input_ids`` int64 ``(rows, local_seq)``; a later stage's input
            hidden states ``(rows, local_seq, hidden)``.
        position_ids: int64 ``(rows, local_seq)``, the global positions of this CP shard.
        doc_bounds: packed rows only: int ``(1, max_docs + 1)``, the row's global document
            bounds, padded with -1 (``hf_ring.pipeline.microbatches``).
        shift_labels: with ``chunked_loss`` only: int64 ``(rows, local_seq)``, -100 where
            nothing is learned. The schedule hands every stage the same keyword arguments;
            only a chunking last stage reads it.

    Returns the hidden states ``(rows, local_seq, hidden)``; on the last stage the logits
    ``(rows, local_seq, vocab)``, or with ``chunked_loss`` the float32 scalar sum of this CP
    shard's token losses (``hf_ring.training.loss.token_loss_sum`` of those logits).
    """

    def __init__(self, lm: nn.Module, stage_index: int, num_stages: int,
                 chunked_loss: Optional[ChunkedLossConfig] = None):
        super().__init__()
        self.lm = lm
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        if chunked_loss is not None and not self.is_last:
            raise ValueError(f"stage {stage_index} of {num_stages} holds no LM head: only the last computes the loss")
        self.chunked_loss = chunked_loss

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, doc_bounds: Optional[torch.Tensor] = None,
                shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"position_ids": position_ids, "use_cache": False}
        if doc_bounds is not None:
            bounds = doc_bounds.reshape(-1)
            bounds = bounds[bounds >= 0].to(torch.int32)
            longest = int((bounds[1:] - bounds[:-1]).max())
            kwargs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds.clone(), max_length_q=longest,
                          max_length_k=longest)
        kwargs.update({"input_ids": x} if self.is_first else {"inputs_embeds": x})
        if not self.is_last:
            return self.lm.base_model(**kwargs).last_hidden_state
        if self.chunked_loss is None:
            return self.lm(**kwargs).logits
        if shift_labels is None:
            raise ValueError("the last stage computes the chunked loss and needs the micro-batch's shift_labels")
        # Through the view's own forward, the loss inside the head's call (as at pp_size 1).
        token_sum, _ = model_token_loss_sum(self.lm, self.lm, kwargs, shift_labels, self.chunked_loss)
        return token_sum


def build_stage_modules(model: nn.Module, stage_ids: list[int], ranges: list[tuple[int, int]],
                        chunked_loss: Optional[ChunkedLossConfig] = None) -> dict[int, StageModule]:
    """This rank's stages of ``model`` (a causal LM), by stage index; prunes ``model`` to them.

    Args:
        model: the causal LM (``LlamaForCausalLM``, ...), checked by
            :func:`hf_ring.pipeline.refusals.check_pipeline_model`.
        stage_ids: the stage indices this rank holds (``split.stages_of_rank``).
        ranges: every stage's ``[start, end)`` decoder layers (``split.stage_layer_ranges``).
        chunked_loss: the last stage's chunked loss (:class:`StageModule`), or None.
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
        stages[s] = StageModule(lm_view, s, num_stages, chunked_loss if s == num_stages - 1 else None)
    return stages


__all__ = ["SkippedLayer", "StageModule", "build_stage_modules"]
