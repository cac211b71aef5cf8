"""GPT-OSS's attention sinks (``s_aux``) under ``ring_flash``, with and without context
parallelism, against transformers' eager attention (the implementation transformers
itself runs GPT-OSS with): logits and every parameter's gradient, the sinks' included.

Before hf_ring computed sinks, ``ring_flash`` dropped them even without CP (logits off by
0.15). Tolerances: 1e-5 relative for logits without CP (the same float32 math in another
order), 1e-4 for gradients and under CP (the ring reorders the softmax sums; measured
~1e-6). The no-CP case includes a sliding window shorter than the sequence (GPT-OSS
alternates sliding and full layers), which the mask carries.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, GptOssConfig

import hf_ring
from distributed import run_world
from closeness import rel_err

VOCAB, SEQ, BATCH = 128, 16, 2


def _config(window: int) -> GptOssConfig:
    return GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, max_position_embeddings=256, sliding_window=window, pad_token_id=0,
    )


def _model(config, implementation: str, state_dict=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    with torch.no_grad():  # sinks start at zero-ish; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.float().train()


def _run(model, ids, positions, weights) -> dict:
    logits = model(ids, position_ids=positions).logits
    (logits * weights).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _case(window: int) -> dict:
    g = torch.Generator().manual_seed(1)
    config = _config(window)
    return {"config": config, "state_dict": _model(config, "eager").state_dict(),
            "ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),
            "weights": torch.randn(BATCH, SEQ, VOCAB, generator=g)}


def _reference(case: dict) -> dict:
    positions = torch.arange(SEQ).expand(BATCH, -1)
    return _run(_model(case["config"], "eager", case["state_dict"]), case["ids"], positions, case["weights"])


def _assert_close(got: dict, want: dict, logits_tol: float) -> None:
    assert rel_err(got["logits"], want["logits"]) <= logits_tol
    largest = max(g.norm() for g in want["grads"].values())
    for name, g in want["grads"].items():
        if g.norm() > 1e-3 * largest:
            assert rel_err(got["grads"][name], g) <= 1e-4, name
    assert any("sinks" in n for n in want["grads"])


def test_sinks_without_cp_match_eager():
    hf_ring.set_context_parallel_state(None)
    case = _case(window=4)  # shorter than the sequence: the mask carries it
    got = _run(_model(case["config"], "ring_flash", case["state_dict"]), case["ids"],
               torch.arange(SEQ).expand(BATCH, -1), case["weights"])
    _assert_close(got, _reference(case), 1e-5)


def _on_rank(rank: int, world: int, case: dict) -> dict:
    hf_ring.setup_context_parallel(world)
    shard = lambda t: hf_ring.shard_sequence(t, world, rank)  # noqa: E731
    model = _model(case["config"], "ring_flash", case["state_dict"])
    return _run(model, shard(case["ids"]), shard(torch.arange(SEQ).expand(BATCH, -1)), shard(case["weights"]))


def test_sinks_under_cp_match_eager():
    case = _case(window=128)  # covers the sequence: nothing for the window to mask
    ranks = run_world(2, _on_rank, case)
    got = {"logits": hf_ring.unshard_sequence([r["logits"] for r in ranks]),
           "grads": {n: sum(r["grads"][n] for r in ranks) for n in ranks[0]["grads"]}}
    _assert_close(got, _reference(case), 1e-4)
