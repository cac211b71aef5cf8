"""Where a hybrid model's step goes, by kind of layer: the bytes each kind saves for the
backward in one forward, and the time each kind takes, forward and backward.

Kinds: ``mixers`` are the token-mixer layers hf_ring routes to its CP ops (the classes of
``hf_ring.patches.transformers.mixers.ROUTES``, the modules whose
:func:`hf_ring.hf.mixers.required_steps` is non-empty once routed: Qwen3.5's gated delta
nets, LFM2's short convolutions); ``attention`` the modules named ``self_attn``; everything else
(MLPs, norms, embeddings, the LM head and loss, the optimizer) is the rest.

Saved bytes (:func:`saved_bytes`): every tensor autograd saves during the forward
(``torch.autograd.graph.saved_tensors_hooks``: ``save_for_backward`` and every built-in
op's saved inputs and outputs), plus the tensors that custom autograd functions keep as
attributes of their ``ctx`` (the hooks do not see those: hf_ring's gated delta rule keeps
its summaries there), found by walking the autograd graph. Tensors are counted by their
storage, once per storage (``data_ptr``), its whole size (a saved view keeps its whole
storage alive); parameters and buffers are left out (they are not activations). The
mixer figure counts only what is saved while a mixer layer's forward runs (and the
``ctx`` tensors of the autograd nodes it creates).

Times (:class:`LayerTimer`): wall clock (``time.perf_counter``) and this process's CPU
time (``time.process_time``) around each layer's forward (forward pre- and post-hooks)
and around its backward: from the moment its output's gradient is computed (a hook on
the output tensor) to the moment its input's is (a hook on the input, which in these
models only the layer reads: the normed hidden states). Autograd's
CPU engine runs the nodes of one layer before those of earlier layers (it takes the
ready node of highest sequence number first), so that interval is the layer's backward,
collectives included.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

KINDS = ("mixers", "attention")


def layers_by_kind(model: nn.Module) -> dict[str, list[nn.Module]]:
    """``{"mixers": [...], "attention": [...]}``: the token mixers hf_ring routes (their
    class is in ``ROUTES``: on a model built with ``attn_implementation="ring_flash"``, the
    modules whose ``required_steps`` is non-empty) and the ``self_attn`` modules."""
    from hf_ring.patches.transformers.mixers import route_of

    return {
        "mixers": [m for m in model.modules() if route_of(type(m)) is not None],
        "attention": [m for name, m in model.named_modules() if name.split(".")[-1] == "self_attn"],
    }


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or nested tuples, lists and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _nodes(roots, stop: set) -> Iterator[Any]:
    """The autograd nodes reachable from ``roots``, not walking into ``stop``."""
    seen, todo = set(stop), [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(n for n, _ in node.next_functions if n is not None)


def _ctx_tensors(nodes) -> Iterator[torch.Tensor]:
    """The tensors custom autograd functions keep on their ``ctx`` (not saved_tensors)."""
    for node in nodes:
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            for value in vars(node).values():
                yield from _tensors(value)


def _grad_fns(tensors) -> set:
    return {t.grad_fn for t in tensors if t.grad_fn is not None}


@dataclass
class _Storages:
    """Storages counted once each, by data pointer (held, so that none is reused meanwhile)."""

    exclude: set
    held: dict = field(default_factory=dict)
    first_seen: dict = field(default_factory=dict)  # ptr -> (shape, dtype) of the first tensor seen on it

    def add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.is_sparse:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.exclude:
            self.held[ptr] = storage
            self.first_seen.setdefault(ptr, (tuple(t.shape), str(t.dtype).replace("torch.", "")))

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self.held.values())

    def listing(self) -> list[tuple[tuple, str, int]]:
        """``(shape, dtype, storage bytes)`` per storage, largest first."""
        rows = [(*self.first_seen[p], s.nbytes()) for p, s in self.held.items()]
        return sorted(rows, key=lambda r: -r[2])


def saved_bytes(model: nn.Module, forward: Callable[[], Any], listing: bool = False) -> dict[str, Any]:
    """Run ``forward()`` (a forward of ``model`` with grad enabled) and count what it saves
    for the backward: ``{"total": bytes, "mixers": bytes}`` (module docstring), with
    ``listing``: also ``"mixer_storages"``, ``(shape, dtype, bytes)`` of each storage the
    mixers save (the shape of the first tensor seen on it), largest first: where to look
    for a full-sequence buffer. The graph is dropped afterwards (no backward is run)."""
    exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    total, mixers = _Storages(exclude), _Storages(exclude)
    inside = [0]
    mixer_inputs: dict[int, set] = {}
    mixer_outputs: list = []

    def pre(module, args, kwargs):
        inside[0] += 1
        mixer_inputs[id(module)] = _grad_fns(_tensors((args, kwargs)))

    def post(module, args, kwargs, output):
        inside[0] -= 1
        mixer_outputs.append((_grad_fns(_tensors(output)), mixer_inputs.pop(id(module))))

    def pack(t: torch.Tensor) -> torch.Tensor:
        total.add(t)
        if inside[0]:
            mixers.add(t)
        return t

    handles = []
    for m in layers_by_kind(model)["mixers"]:
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        for h in handles:
            h.remove()
    for t in _ctx_tensors(_nodes(_grad_fns(_tensors(out)), set())):
        total.add(t)
    for outputs, inputs in mixer_outputs:
        for t in _ctx_tensors(_nodes(outputs, inputs)):
            mixers.add(t)
    result: dict[str, Any] = {"total": total.bytes, "mixers": mixers.bytes}
    if listing:
        result["mixer_storages"] = mixers.listing()
    del out
    return result


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class LayerTimer:
    """Seconds spent in each kind's forwards and backwards while :meth:`active` (module
    docstring): ``seconds[kind][phase]`` for phase ``forward``, ``backward`` (wall clock),
    ``forward_cpu``, ``backward_cpu`` (this process's CPU time)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.seconds = {k: {p: 0.0 for p in ("forward", "backward", "forward_cpu", "backward_cpu")} for k in KINDS}

    def _hooks(self, kind: str) -> tuple[Callable, Callable]:
        forward_starts: dict[int, tuple] = {}  # by module
        backward_starts: dict[int, tuple] = {}  # by input tensor
        add = self.seconds[kind]

        def first_grad_tensor(obj) -> Any:
            return next((t for t in _tensors(obj) if t.requires_grad), None)

        def count(phase: str, start: tuple) -> None:
            wall, cpu = _now()
            add[phase] += wall - start[0]
            add[phase + "_cpu"] += cpu - start[1]

        def stop(key: int) -> None:
            start = backward_starts.pop(key, None)
            if start is not None:
                count("backward", start)

        def pre(module, args, kwargs):
            x = first_grad_tensor((args, kwargs))
            if x is not None:  # the backward ends when the input's gradient is complete
                x.register_hook(lambda g, key=id(x): stop(key))
            forward_starts[id(module)] = _now()

        def post(module, args, kwargs, output):
            count("forward", forward_starts.pop(id(module)))
            x, y = first_grad_tensor((args, kwargs)), first_grad_tensor(output)
            if x is not None and y is not None:  # ... and starts when the output's is
                y.register_hook(lambda g, key=id(x): backward_starts.__setitem__(key, _now()))

        return pre, post

    @contextmanager
    def active(self) -> Iterator["LayerTimer"]:
        handles = []
        for kind, modules in layers_by_kind(self.model).items():
            pre, post = self._hooks(kind)
            for m in modules:
                handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(m.register_forward_hook(post, with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
