"""Runs the token mixers of hybrid and recurrent models exactly under context parallelism
and on packed rows: the runners that ``patches/transformers/mixers.py`` puts in place of
the modeling modules' mixing functions and around the mixer layers' forwards.

Why: those functions see only this rank's shard under CP (and a packed row's documents
as one sequence). A routed layer's forward finds the guarded :class:`ForwardContext` in
its keyword arguments (or, for the Mamba-1 mixers that their blocks call without them,
in its carrier's) and, under CP or on packed rows, makes it the active one for the
functions it calls (a context variable set only for the layer's call: the functions get
no other channel). Under CP they call :mod:`hf_ring.mixers`' ops on the shard (group and
layout from the context's state; packed rows: each document zigzag-sharded on its own,
``local_doc_lens = doc_lens // cp_size``; a row placed by length, ``placement="by_length"``:
the op on the sharded documents, the original once per document the rank holds whole, so
their states never leave it); on packed rows without CP, the original once per document;
otherwise the original, unchanged. The fused whole-layer GPU shortcuts are
declined (they return None, as without a kernel), so the layer takes its split path.
Each layer notes in the context every function that ran its CP path, so that the guard
can check, after the forward, that none was bypassed. In a generation prefill under CP
(``hf_ring.hf.generation``) a gated delta net's or a short convolution's layer takes its
cache: the delta rule returns each row's state after the row (its padding columns made to
leave it as it is) and the convolution puts each row's last inputs together, which the
generation's exit gives the cache; decode steps run the originals on whole rows.

Under ``torch.compile`` a routed layer's call is one custom op whose body runs the layer as
above (``compiled.py``).

Owns: ``route_mixers``, ``required_steps``; the layers' forwards and ``head_inputs``
(``layers.py``), the runners (``runners.py``), the compiled layer's op (``compiled.py``). Must not import: Trainer, TRL, hf_ring's
training or memory layers.
"""

from __future__ import annotations

import torch.nn as nn

from hf_ring.hf.mixers.compiled import note_forward_names
from hf_ring.hf.mixers.layers import HEAD_INPUT_NAMES, head_inputs, run_carrier, run_head, run_layer
from hf_ring.hf.mixers.runners import RUNNERS
from hf_ring.patches.transformers.mixers import is_routed_layer, mark_routed, route, route_of


def route_mixers(model: nn.Module) -> list[nn.Module]:
    """Route every token-mixer layer class of ``model`` that hf_ring knows (idempotent) and
    mark its layers; returns the model's layers that are routed."""
    routed = set()
    for cls in {type(m) for m in model.modules()}:
        spec = route_of(cls)
        if spec is not None and all(name in RUNNERS for name in spec.runs + spec.fused):
            if route(cls, run_layer, run_carrier, run_head, RUNNERS):
                routed.add(cls)
    layers = [m for m in model.modules() if type(m) in routed]
    for m in layers:
        mark_routed(m)
        note_forward_names(m)
    return layers


def required_steps(module: nn.Module) -> tuple[str, ...]:
    """The functions a routed layer must have run on hf_ring's path in a forward under CP."""
    spec = route_of(type(module))
    return spec.runs if spec is not None and is_routed_layer(module) else ()


__all__ = ["HEAD_INPUT_NAMES", "RUNNERS", "head_inputs", "required_steps", "route_mixers", "run_carrier", "run_head",
           "run_layer"]
