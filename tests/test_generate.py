"""Generation under context parallelism (issue 35): ``model.generate(<the full prompt>)``
called alike on every rank of a CP group, against one process generating with SDPA (eager
where only eager computes the model's attention).

On gloo worlds of 2 and 4 (zigzag), float32, sweep-sized models: the prompt (13 tokens at
cp 2, 29 at cp 4: neither a multiple of the layout's 2 x cp) is prefilled by the ring into
a ``ShardedCache`` and decoded against every rank's share. Checked:

- greedy tokens equal one process's, every rank, and the logits of every step within 1e-5
  (absolute; float32 attention over a few dozen keys is ~1e-7 off by summation order) for
  Llama (GQA, 300 new tokens at cp 2), Qwen3 with a sliding window of 6 on its second layer
  (the window crosses the shards and the cache forgets what it will not see again: each
  rank ends holding at most a window's entries of that layer), Qwen3-MoE and DeepSeek-V3
  (multi-head latent attention, value heads narrower than the keys), Gemma 2 (logit
  softcapping, a window of 8 on alternate layers) and GPT-OSS (attention sinks, a window, MoE),
  those two against transformers' eager attention (at cp 4: Llama and the windowed Qwen3);
- sampling (temperature 0.7, top-k 20) at the same seed gives one process's tokens, and so do
  beam search (3 beams: the cache's rows reordered every step) and two samples per prompt;
- ``ShardedCache(decode="gathered")`` gives the same tokens and logits, and a prefill's
  cache put in order equals one process's ``DynamicCache``, keys and values, every layer;
- Qwen3.5 (gated delta nets beside attention; transformers 5.24): the prefill's convolution
  and recurrent states over the whole rows handed to decoding, at cp 2 and 4; LFM2 (short
  convolutions) at cp 2;
- a left-padded batch (the second row 4 tokens shorter) gives one process's tokens and
  logits (Llama, Qwen3 with the window, Qwen3.5 and LFM2: each row's padding leaves its state
  as it is);
- refused on every rank, by name: a mask with holes, Mamba-2's states (Granite 4), left
  padding beside mixers whose projections add a bias, a cache filled without hf_ring,
  attention dropout drawn in training mode on a left-padded batch; and on
  every rank when one rank alone differs (its prompt, its ``logits_to_keep``), none left
  waiting in a collective;
- a forward that raised midway leaves no entry behind in the cache it was filling.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from packaging.version import Version

import hf_ring
from distributed import run_world
from hf_ring.hf.generation import CacheStep
from model_sweep_configs import build_config

CACHE = "cache" if Version(transformers.__version__) >= Version("5") else "past_key_values"
PROMPT_LEN = {2: 13, 4: 29}
NEW_TOKENS = {"llama": 300, "qwen3_window": 40, "qwen3_moe": 24, "deepseek_v3": 24, "gemma2": 24, "gpt_oss": 24,
              "qwen3_5_text": 24, "lfm2": 24}
TOL = 1e-5
# Hybrid models generate under CP on transformers 5.24 (4.57 refuses their token mixers under CP).
NEW = Version(transformers.__version__) >= Version("5.24")
HYBRID = ["qwen3_5_text"] if NEW else []
# Also generated from a left-padded batch (the second row 4 tokens shorter).
PADDED = ("llama", "qwen3_window", "qwen3_5_text", "lfm2")
# Softcapping (Gemma 2) and sinks (GPT-OSS) are computed by transformers' eager attention only.
EAGER = ("gemma2", "gpt_oss")


def _new_tokens(name: str, world: int) -> int:
    """Llama decodes 300 tokens at cp 2; the world of 4 (4 processes on 2 cores) runs shorter."""
    return min(NEW_TOKENS[name], 48) if world == 4 else NEW_TOKENS[name]


def _config(name: str):
    config = build_config("qwen3" if name == "qwen3_window" else name)
    config.use_cache = True  # the sweep's configs turn it off, for training
    if name != "qwen3_window":
        return config
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 6, 1
    config.layer_types = ["full_attention", "sliding_attention"]  # layer 1 a window of 6 tokens
    return config


def _model(name: str, attn: str):
    if attn == "sdpa" and name in EAGER:
        attn = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name)).float().eval()
    model.set_attn_implementation(attn)
    return model


def _prompt(world: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, PROMPT_LEN[world]), generator=torch.Generator().manual_seed(world))


def _left_padded(prompt: torch.Tensor) -> torch.Tensor:
    """The prompt's mask with its second row's first 4 tokens padding (a shorter prompt)."""
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    return mask


def _generate(model, prompt, new_tokens: int, mask=None, **kwargs):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt) if mask is None else mask,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _beams_and_copies(model, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Beam search (the cache's rows reordered every step) and two samples per prompt (its
    rows repeated)."""
    ones = torch.ones_like(prompt)
    beams = model.generate(prompt, attention_mask=ones, max_new_tokens=12, do_sample=False, num_beams=3)
    torch.manual_seed(5)
    copies = model.generate(prompt, attention_mask=ones, max_new_tokens=12, do_sample=True, num_return_sequences=2)
    return beams, copies


def _sampled(model, prompt, cache=None):
    torch.manual_seed(123)
    kwargs = {CACHE: cache} if cache is not None else {}
    return _generate(model, prompt, 16, do_sample=True, temperature=0.7, top_k=20, **kwargs)[0]


def _greedy_on_rank(rank: int, world: int, names: list[str]) -> dict:
    state = hf_ring.setup_context_parallel(world)
    out = {}
    for name in names:
        model = _model(name, "ring_flash")
        prompt = _prompt(world, model.config.vocab_size)
        out[name] = _generate(model, prompt, _new_tokens(name, world))
        if name in PADDED:
            out[name + "_padded"] = _generate(model, prompt, 24, _left_padded(prompt))
        if name == "qwen3_window":
            cache = hf_ring.ShardedCache()
            _generate(model, _prompt(world, model.config.vocab_size), 12, **{CACHE: cache})
            out["window_entries"] = [layer.columns.numel() for layer in cache.layers]
    model = _model("llama", "ring_flash")
    prompt = _prompt(world, model.config.vocab_size)
    out["gathered"] = _generate(model, prompt, 24, **{CACHE: hf_ring.ShardedCache(decode="gathered")})
    out["sampled"] = _sampled(model, prompt)
    out["beams_and_copies"] = _beams_and_copies(model, prompt)
    with torch.no_grad():
        cache = model(prompt, use_cache=True)[CACHE]
    out["in_order"] = [cache.layer_in_order(i, state.cp_group) for i in range(len(cache.layers))]
    out["refusals"] = _refusals(model, prompt, rank)
    return out


def _refusals(model, prompt, rank: int) -> dict:
    found = {}
    holes = torch.ones_like(prompt)
    holes[0, 3] = 0
    cases = {
        "holes": lambda: model.generate(prompt, attention_mask=holes, max_new_tokens=2),
        # One rank alone differs: every rank must raise, none may wait in a collective.
        "other prompt on rank 1": lambda: model.generate(prompt.flip(1) if rank == 1 else prompt, max_new_tokens=2),
        "other logits_to_keep on rank 1": lambda: _prefill_keeping(model, prompt, 1 + rank),
        "filled cache": lambda: _next_step(model, prompt, _filled_cache(model, prompt)),
        # A dropout drawn in training mode: the prefill's columns (prompts moved before their
        # left padding) are not one process's, so neither would its mask be.
        "dropout in training mode": lambda: _dropping(model).generate(prompt, attention_mask=_left_padded(prompt),
                                                                    max_new_tokens=2),
    }
    for what, call in cases.items():
        try:
            call()
            found[what] = "no error"
        except (NotImplementedError, ValueError) as e:
            found[what] = str(e)
    return found


def _dropping(model):
    """A copy of ``model`` in training mode that drops 10 % of each MLP's output, as families
    with a hidden dropout do (attention dropout is refused under CP before generation)."""
    dropping = copy.deepcopy(model).train()
    for layer in dropping.model.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: torch.nn.functional.dropout(out, 0.1, True))
    return dropping


def _prefill_keeping(model, prompt, keep: int):
    with torch.no_grad():
        return model(prompt, use_cache=True, logits_to_keep=keep)


def _next_step(model, prompt, cache):
    with torch.no_grad():
        return model(prompt[:, -1:], use_cache=True, **{CACHE: cache})


def _filled_cache(model, prompt):
    with hf_ring.context_parallel_suspended(), torch.no_grad():
        model.set_attn_implementation("sdpa")
        try:
            return model(prompt, use_cache=True)[CACHE]
        finally:
            model.set_attn_implementation("ring_flash")


@pytest.mark.parametrize("world,names", [(2, ["llama", "qwen3_window", "qwen3_moe", "deepseek_v3", "gemma2",
                                              "gpt_oss", *HYBRID, *(["lfm2"] if NEW else [])]),
                                         (4, ["llama", "qwen3_window", "qwen3_moe", "deepseek_v3", *HYBRID])])
def test_generate_under_cp_is_one_process_generate(world, names):
    ranks = run_world(world, _greedy_on_rank, names)
    for name in names:
        reference = _model(name, "sdpa")
        tokens, logits = _generate(reference, _prompt(world, reference.config.vocab_size), _new_tokens(name, world))
        for rank, r in enumerate(ranks):
            got_tokens, got_logits = r[name]
            assert torch.equal(got_tokens, tokens), f"{name} rank {rank}: tokens differ"
            err = (got_logits - logits).abs().max().item()
            assert err <= TOL, f"{name} rank {rank}: logits {err:.2e} off"
        if name in PADDED:
            prompt = _prompt(world, reference.config.vocab_size)
            tokens, logits = _generate(reference, prompt, 24, _left_padded(prompt))
            for rank, r in enumerate(ranks):
                got_tokens, got_logits = r[name + "_padded"]
                assert torch.equal(got_tokens, tokens), f"{name} left-padded, rank {rank}: tokens differ"
                err = (got_logits - logits).abs().max().item()
                assert err <= TOL, f"{name} left-padded, rank {rank}: logits {err:.2e} off"
    if "qwen3_window" in names:
        for r in ranks:
            full, window = r["window_entries"]
            assert full > 0 and window <= 6, r["window_entries"]  # each rank's share of a 6-token window
        assert sum(r["window_entries"][1] for r in ranks) == 5, "the group holds the 5 entries the next token sees"
    reference = _model("llama", "sdpa")
    prompt = _prompt(world, reference.config.vocab_size)
    tokens, logits = _generate(reference, prompt, 24)
    sampled = _sampled(reference, prompt)
    beams_and_copies = _beams_and_copies(reference, prompt)
    with torch.no_grad():
        one_cache = reference(prompt, use_cache=True)[CACHE]
    for r in ranks:
        assert torch.equal(r["gathered"][0], tokens) and (r["gathered"][1] - logits).abs().max() <= TOL
        assert torch.equal(r["sampled"], sampled)
        assert all(torch.equal(got, want) for got, want in zip(r["beams_and_copies"], beams_and_copies))
        for i, (keys, values) in enumerate(r["in_order"]):
            layer = one_cache.layers[i]
            assert torch.allclose(keys, layer.keys, atol=1e-6, rtol=0), f"layer {i} keys"
            assert torch.allclose(values, layer.values, atol=1e-6, rtol=0), f"layer {i} values"
        assert "padding after a real token" in r["refusals"]["holes"], r["refusals"]
        for what in ("other prompt on rank 1", "other logits_to_keep on rank 1"):
            assert "differ across the ranks" in r["refusals"][what] and "full_batch_digest" in r["refusals"][what], \
                (what, r["refusals"][what])
        assert "already holds tokens" in r["refusals"]["filled cache"], r["refusals"]
        assert "generate in eval mode" in r["refusals"]["dropout in training mode"], r["refusals"]


def _mixers_refused_on_rank(rank: int, world: int) -> dict:
    hf_ring.setup_context_parallel(world)
    found = {}
    granite = _model("granitemoehybrid", "ring_flash")
    config = _config("lfm2")
    config.conv_bias = True  # its projections add a bias, which one process feeds its left padding
    torch.manual_seed(0)
    biased = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    biased.set_attn_implementation("ring_flash")
    prompt = _prompt(world, biased.config.vocab_size)
    cases = {"mamba2": lambda: granite.generate(_prompt(world, granite.config.vocab_size), max_new_tokens=2),
             "biased left padding": lambda: biased.generate(prompt, attention_mask=_left_padded(prompt),
                                                            max_new_tokens=2)}
    for what, call in cases.items():
        try:
            call()
            found[what] = "no error"
        except NotImplementedError as e:
            found[what] = str(e)
    return found


@pytest.mark.skipif(not NEW, reason="hf_ring's CP token mixers need transformers 5.24; 4.57 refuses them under CP")
def test_generate_refuses_mixers_it_cannot_hand_over():
    for found in run_world(2, _mixers_refused_on_rank):
        assert "not yet handed to decoding" in found["mamba2"] and "context_parallel_suspended" in found["mamba2"], \
            found
        assert "add a bias" in found["biased left padding"], found


def test_a_forward_that_failed_midway_is_undone():
    """The layers that stored their K/V before a forward raised give them back when the next
    forward begins (one process: the cache's bookkeeping alone)."""
    cache = hf_ring.ShardedCache()
    keys = torch.randn(1, 2, 4, 8)

    def step(columns: list[int]):
        n = len(columns)
        return CacheStep(columns=torch.tensor(columns), positions=torch.tensor([columns]),
                         valid=torch.ones(1, n, dtype=torch.bool), keep=torch.ones(n, dtype=torch.bool),
                         next_positions=torch.tensor([columns[-1] + 1]), decoding=False, length_after=columns[-1] + 1)

    cache.begin(step([0, 1, 2, 3]))
    for layer in range(2):
        cache.update(keys, keys, layer)
    cache.end()
    cache.begin(step([4, 5, 6, 7]))
    cache.update(keys, keys, 0)  # layer 0 stored, then the forward raised before layer 1
    assert cache.pending and cache.layers[0].entry_count() == 8
    cache.begin(step([4, 5, 6, 7]))  # the retry
    assert [layer.entry_count() for layer in cache.layers] == [4, 4]
    for layer in range(2):
        cache.update(keys, keys, layer)
    cache.end()
    assert [layer.columns.tolist() for layer in cache.layers] == [list(range(8))] * 2
