"""Generation with a model trained under context parallelism (issue 22).

On a gloo world of 2 (one CP group), a tiny Llama with ``ring_flash``: ``generate()`` under CP
is refused on every rank with an error naming generate() and the way out;
inside ``hf_ring.context_parallel_suspended()`` it returns, on every rank, exactly the tokens
one process generates with SDPA (greedy decoding, float32: the same local attention, so
the same argmax; compared for equality), and on one rank alone it returns without waiting
for the other (nothing inside is collective); the state is active again after the block,
also when the block raised.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_ring
from distributed import run_world


def _model(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config).float().eval()
    model.set_attn_implementation(attn)
    return model


PROMPT = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _rank_main(rank: int, world: int) -> dict:
    state = hf_ring.setup_context_parallel(world)
    model = _model("ring_flash")
    try:
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
        refused = "no error"
    except NotImplementedError as e:
        refused = str(e)
    with hf_ring.context_parallel_suspended():
        everywhere = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    alone = None
    if rank == 0:
        with hf_ring.context_parallel_suspended():
            alone = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    try:
        with hf_ring.context_parallel_suspended():
            raise KeyError("inside")
    except KeyError:
        pass
    return {"refused": refused, "everywhere": everywhere, "alone": alone,
            "restored": hf_ring.get_context_parallel_state() is state}


def test_generate_suspended_is_one_process_generate():
    ranks = run_world(2, _rank_main)
    reference = _model("sdpa").generate(PROMPT, max_new_tokens=4, do_sample=False)
    for r in ranks:
        assert "generate()" in r["refused"] and "context_parallel_suspended" in r["refused"], r["refused"]
        assert torch.equal(r["everywhere"], reference)
        assert r["restored"]
    assert torch.equal(ranks[0]["alone"], reference)
