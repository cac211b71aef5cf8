"""The chunked LM-head loss under ``torch.compile``, in one process (no CP: chunking forced on).

``model_token_loss_sum`` on a compiled tiny Llama, three steps of other sequence lengths,
against the same call on an uncompiled copy: the loss and every gradient equal within 1e-6
relative (measured 0: the op's body is the eager autograd Function and ``aot_eager`` runs
the same aten ops around it; the bound leaves room for a reordered float32 sum, not for a
wrong chunk, whose error is of the order of the loss). Before the custom op, dynamo broke the
graph at the Function's ``nonzero`` and compiled the rest of the head's call again at every
step (a new closure each call, and the labels' length specialised), until its recompile limit
ran that frame uncompiled: here the forward compiles as one frame, recompiled once when the
length first changes (dynamic shapes) and never after, and the op ran at every step. An
evaluation under ``no_grad`` runs the op too, and leaves no tape or labels behind.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from closeness import grads, rel_err
from test_hf_attention import VOCAB, tiny_config, tiny_model

TOL = 1e-6
LENGTHS = (16, 12, 20)  # the second changes the length (one recompile), the third compiles nothing


def _step(model, params, ids, labels):
    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum

    params.zero_grad(set_to_none=True)
    total, outputs = model_token_loss_sum(model, params, {"input_ids": ids}, labels, ChunkedLossConfig(True, 5))
    assert outputs.logits.shape[-1] == 0  # the full logits never existed
    total.backward()
    return total.detach(), grads(params)


def test_compiled_chunked_loss_equals_eager_and_compiles_once_per_shape_kind():
    from hf_ring.memory import chunked_loss_compiled
    from hf_ring.patterns.compiled import live_tapes

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = tiny_config("llama", num_hidden_layers=1)
    model, eager = (tiny_model(config, "sdpa", seed=3).train() for _ in range(2))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    frames = []
    for step, length in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(3, VOCAB, (2, length), generator=g)
        labels = torch.randint(0, VOCAB, (2, length), generator=g)
        labels[:, : length // 3] = -100  # rows without a label, skipped by the chunks
        calls = chunked_loss_compiled.OP_CALLS["chunked_linear_cross_entropy"]
        got, got_grads = _step(compiled, model, ids, labels)
        assert chunked_loss_compiled.OP_CALLS["chunked_linear_cross_entropy"] == calls + 1  # compiled, not eager
        want, want_grads = _step(eager, eager, ids, labels)
        assert rel_err(got, want) <= TOL, (got, want)
        errors = {n: rel_err(v, want_grads[n]) for n, v in got_grads.items()}
        assert set(errors) == set(want_grads) and max(errors.values()) <= TOL, errors
        frames.append(counter.frame_count)
        assert not counters["graph_break"], dict(counters["graph_break"])  # one graph per compiled frame
    assert frames == [1, 2, 2], frames
    with torch.no_grad():  # evaluation: the op runs without recording a tape
        from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum

        total, _ = model_token_loss_sum(compiled, model, {"input_ids": ids}, labels, ChunkedLossConfig(True, 5))
    assert rel_err(total, want) <= TOL
    assert live_tapes() == 0 and not chunked_loss_compiled._LABELS


def test_a_vocabulary_sharded_head_is_refused_by_name_under_compile():
    from hf_ring.memory.chunked_loss import LogitTransform
    from hf_ring.memory.chunked_loss_compiled import compiled_chunked_loss

    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(NotImplementedError, match="vocabulary-sharded LM head"):
        compiled_chunked_loss(hidden, weight, None, torch.tensor(0), 2, LogitTransform(), shard=object())
