"""The CUDA path of offloaded checkpointing, checked on the CPU through a stand-in copy engine.

``DeferredCopies`` behaves like a GPU that has not run the queued copies yet: a copy to the
host reads its source only when the host waits for it (so an in-place write queued before
that lands in the "saved" copy, as it would on a real side stream), a copy back runs when
it is used; it records every call in order. Checked:

- an in-place write to a saved tensor while its copy may be pending raises, naming the
  consequence and what to do (plain checkpointing refuses the same write); with the check
  removed, the stand-in yields wrong gradients: the race it emulates is real;
- the backward prefetches: restoring layer i issues layer i-1's copy back before layer i
  is recomputed, with at most one restore ahead and at most two copies to the host in flight;
- loss and every gradient through the stand-in equal plain checkpointing's (the copies are
  bitwise: compared exactly, and the tiny Llama within 1e-12 of its scale in float64, the
  tolerance of ``test_long_context_memory.py``, whose other checks are not repeated here).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import hf_ring.memory.offload as offload
from hf_ring.memory.offload import OffloadPipeline, enable_offloaded_checkpointing, offloaded_checkpoint

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


class DeferredCopies:
    """A copy engine whose copies run late, as queued GPU work does; ``log`` records calls."""

    deferred = True

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._ids: dict[int, int] = {}  # id(host tensor) -> pack number

    def to_host(self, tensor):
        host, k = torch.empty_like(tensor), len(self._ids)
        self._ids[id(host)] = k
        self.log.append(("to_host", k))
        return host, {"k": k, "run": lambda: host.copy_(tensor.detach()), "ran": False}

    @staticmethod
    def _run(token) -> None:
        if not token["ran"]:
            token["run"]()
            token["ran"] = True

    def finished(self, token) -> bool:
        return token["ran"]

    def wait(self, token) -> None:
        self.log.append(("wait", token["k"]))
        self._run(token)

    def to_device(self, host, device, after):
        k = self._ids[id(host)]
        self.log.append(("to_device", k))
        self._run(after)  # the side stream runs its copies in order
        back = torch.empty_like(host)
        return back, {"k": k, "run": lambda: back.copy_(host), "ran": False}

    def use(self, tensor, ready):
        self.log.append(("use", ready["k"]))
        self._run(ready)
        return tensor


def _layers(n: int = 4) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)).double()


def _run(layers, x, step, write_after: int = -1):
    """Loss and gradients of ``layers`` on ``x``, each layer through ``step``; the input of
    layer ``write_after`` is written in place after that layer ran."""
    layers.zero_grad(set_to_none=True)
    h = x
    for i, layer in enumerate(layers):
        out = step(layer, h)
        if i == write_after:
            h.mul_(2.0)
        h = out
    loss = h.square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in layers.parameters()]


def _plain(layer, h):
    return checkpoint(layer, h, use_reentrant=False)


def _offloaded(engine):
    pipeline = OffloadPipeline(engines=lambda device: engine)
    return lambda layer, h: offloaded_checkpoint(layer, h, pipeline=pipeline)


def _input():
    torch.manual_seed(1)
    return torch.randn(3, 8, dtype=torch.float64)


def _hidden():
    # A non-leaf first input, so that an in-place write to it is allowed in the forward.
    return _input().requires_grad_() * 1.0


def test_deferred_copies_are_exact_and_the_backward_prefetches():
    layers, engine = _layers(), DeferredCopies()
    ref = _run(layers, _hidden(), _plain)
    index = {id(layer): i for i, layer in enumerate(layers)}

    def logged(layer):  # module hooks do not fire in the recompute: log from the function
        def fn(t):
            engine.log.append(("compute", index[id(layer)]))
            return layer(t)
        return fn

    pipeline = OffloadPipeline(engines=lambda device: engine)
    got = _run(layers, _hidden(), lambda layer, h: offloaded_checkpoint(logged(layer), h, pipeline=pipeline))
    assert torch.equal(got[0], ref[0]) and all(torch.equal(g, r) for g, r in zip(got[1], ref[1]))

    log = engine.log
    backward = log[log.index(("compute", 3)) + 1:]
    order = [e for e in backward if e[0] != "wait"]
    # Restoring layer i issues layer i-1's copy back before layer i is recomputed.
    assert order == [("to_device", 3), ("to_device", 2), ("use", 3), ("compute", 3),
                     ("to_device", 1), ("use", 2), ("compute", 2),
                     ("to_device", 0), ("use", 1), ("compute", 1),
                     ("use", 0), ("compute", 0)], order
    # Bounds: copies to the host not yet waited for <= 2; copies back issued, not yet used <= 2.
    pending_host, pending_back = set(), set()
    for kind, k in log:
        if kind == "to_host":
            pending_host.add(k)
        elif kind == "wait":
            pending_host.discard(k)
        elif kind == "to_device":
            pending_back.add(k)
        elif kind == "use":
            pending_back.discard(k)
        assert len(pending_host) <= 2 and len(pending_back) <= 2, (kind, k, log)


def test_an_in_place_write_to_a_saved_input_is_refused():
    layers = _layers()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(layers, _hidden(), _plain, write_after=0)  # plain checkpointing refuses it too
    with pytest.raises(RuntimeError, match=r"modified in place after the layer saved it.*wrong gradients.*"
                                           r"out of place.*clone.*checkpoint-offload"):
        _run(layers, _hidden(), _offloaded(DeferredCopies()), write_after=0)


def test_without_the_check_the_emulated_race_gives_wrong_gradients(monkeypatch):
    """The stand-in reproduces the race: with the version check removed, the written values
    reach the saved copy and the gradients are wrong (so the test above can fail)."""
    layers = _layers()
    ref = _run(layers, _hidden(), lambda layer, h: layer(h))  # what the forward computed
    monkeypatch.setattr(offload, "_check_unwritten", lambda source, version: None)
    got = _run(layers, _hidden(), _offloaded(DeferredCopies()), write_after=0)
    assert torch.equal(got[0], ref[0])  # the forward itself ran on the values before the write
    assert not torch.allclose(got[1][0], ref[1][0]), "the emulated race left the gradients intact"


def test_a_write_after_the_copy_ran_is_harmless_and_allowed():
    """A write queued once the copy is known to have run cannot reach the saved values:
    not refused, and the gradients are those of the values the layer saw."""
    layers, engine = _layers(1), DeferredCopies()
    x = _hidden()
    ref = _run(layers, x.detach().clone().requires_grad_() * 1.0, lambda layer, h: layer(h))
    pipeline = OffloadPipeline(engines=lambda device: engine)
    layers.zero_grad(set_to_none=True)
    out = offloaded_checkpoint(layers[0], x, pipeline=pipeline)
    engine.wait(pipeline._in_flight[0][0].done)  # the copy ran (the GPU caught up)
    pipeline._settle(wait_for=None)
    x.detach().mul_(2.0)
    out.square().sum().backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(layers.parameters(), ref[1]))


def test_tiny_llama_through_the_deferred_engine_matches_plain():
    from test_long_context_memory import TOL, _assert_same, _loss_and_grads, _tiny
    from hf_ring.training.loss import token_loss_sum

    model = _tiny("Llama")
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(5))
    loss = lambda m: token_loss_sum(m(input_ids=ids).logits, labels)  # noqa: E731
    ref = _loss_and_grads(model, loss)
    offloaded, engine = copy.deepcopy(model), DeferredCopies()
    enable_offloaded_checkpointing(offloaded, pipeline=OffloadPipeline(engines=lambda device: engine))
    _assert_same(_loss_and_grads(offloaded, loss), ref, TOL[torch.float64])
    assert [k for kind, k in engine.log if kind == "to_device"] == [1, 0]  # layer 1, then layer 0 prefetched
