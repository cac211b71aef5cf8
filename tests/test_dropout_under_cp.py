"""Models that draw random numbers in training, exact under context parallelism on gloo
worlds of 2 and 4 (issue 36): every rank seeds its generator alike (as ``set_seed`` does on
every process) and runs its shard in training mode; the ranks' logits put back in order,
the loss and every parameter's gradient (summed over the ranks) must match one process
running "sdpa" on the full sequence from the same seed.

- Phi with ``resid_pdrop = embd_pdrop = 0.1`` (dense zigzag, a packed row, a packed row
  placed by length, gradient checkpointing, the stripe layout);
- GPT-2 with its default embedding and residual dropout (attention dropout, which the ring
  refuses, set to 0);
- Llama with PEFT LoRA, ``lora_dropout = 0.1`` (gradient checkpointing too);
- PhiMoE with its default router noise (``router_jitter_noise = 0.01``: Gumbel sampling of
  the experts and the Heun mask in training), and with 0.3 and ``input_jitter_noise = 0.1``
  (the tiny router rarely has a second candidate within 0.01), transformers 5 (4.57's PhiMoE
  is refused);
- Mixtral with ``router_jitter_noise = 0.1`` (its default is 0: this runs the jitter).

Before hf_ring drew them in full, every rank drew the same mask for its own tokens: each
case here was off by 1e-2 and more. 1e-4 relative, as the other model tests: the ring
computes the same sums in another order in float32 (measured worst: logits 4.0e-7, gradients 1.1e-6); the masks
themselves are bitwise one process's (``test_masks_are_one_process_masks``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForTokenClassification

import hf_ring
from closeness import grads, rel_err
from distributed import run_world
from hf_ring.hf.randomness.refusals import draws_refused
from hf_ring.sharding import unshard_packed
from hf_ring.sharding.placement import SHARDED, place_by_length, shard_placed
from test_hf_attention import _COMMON, VOCAB, tiny_model
from test_hf_sequence_features import case_shard

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5.0.0.dev0")
TOL = 1e-4
GRAD_FLOOR = 1e-3
BATCH = 2
SEED = 4321

# LoRA's cases where PEFT is installed (the oldest-transformers leg runs without it).
HAVE_PEFT = importlib.util.find_spec("peft") is not None


def _config(family: str):
    if family == "phi":
        return AutoConfig.for_model("phi", **_COMMON, resid_pdrop=0.1, embd_pdrop=0.1)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256,
                                    attn_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family == "llama":
        return AutoConfig.for_model("llama", **_COMMON)
    if family == "phimoe":
        return AutoConfig.for_model("phimoe", **_COMMON, num_local_experts=4)
    if family == "phimoe_noisy":
        # At the default 0.01 the tiny model's router rarely has a second candidate within
        # the noise; at 0.3 the Gumbel sampling picks among several, and the input jitter runs.
        return AutoConfig.for_model("phimoe", **_COMMON, num_local_experts=4, router_jitter_noise=0.3,
                                    input_jitter_noise=0.1)
    if family == "mixtral":
        return AutoConfig.for_model("mixtral", **_COMMON, num_local_experts=4, router_jitter_noise=0.1)
    raise ValueError(family)


# name: (family, options). Options: "packed", "checkpointing", "lora", "tokcls".
CASES = {
    "phi": ("phi", ()),
    "phi_packed": ("phi", ("packed",)),
    # A packed row placed by length: the long document sharded, the short ones whole on a rank.
    "phi_placed": ("phi", ("packed", "placed")),
    "phi_checkpointing": ("phi", ("checkpointing",)),
    "gpt2": ("gpt2", ()),
    **({"llama_lora": ("llama", ("lora",)), "llama_lora_checkpointing": ("llama", ("lora", "checkpointing"))}
       if HAVE_PEFT else {}),
    # Dropout in the head, after the base model's forward: the classifier's (default 0.1).
    "llama_token_classification": ("llama", ("tokcls",)),
    "mixtral_jitter": ("mixtral", ()),
    **({"phimoe": ("phimoe", ()), "phimoe_noisy": ("phimoe_noisy", ()),
        "phimoe_checkpointing": ("phimoe_noisy", ("checkpointing",))} if TRANSFORMERS_5 else {}),
}


def _tiny(config, implementation: str, options: tuple, state_dict=None, seed: int = 0):
    if "tokcls" not in options:
        return tiny_model(config, implementation, state_dict, seed)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(copy.deepcopy(config), attn_implementation=implementation)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.float()


def _model(case: dict, implementation: str):
    model = _tiny(case["config"], implementation, case["options"], case["state_dict"])
    if "lora" in case["options"]:
        import peft

        # lm_head too: its adapter's dropout draws in the head, after the base model's forward.
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                               target_modules=["q_proj", "v_proj", "o_proj", "lm_head"], init_lora_weights=False)
        torch.manual_seed(7)  # the adapters' weights: the same in every process
        model = peft.get_peft_model(model, lora)
    if "checkpointing" in case["options"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _case(name: str, world: int, seed: int) -> dict:
    family, options = CASES[name]
    config = _config(family)
    g = torch.Generator().manual_seed(seed)
    case = {"config": config, "options": options,
            "state_dict": _tiny(config, "sdpa", options, seed=seed).state_dict()}
    if "placed" in options:
        lens = [24 * world, 2 * world, 2 * world, 4 * world, 2 * world]
        case["cu"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        case["positions"] = torch.cat([torch.arange(n) for n in lens])[None]
    elif "packed" in options:
        lens = [2 * world, 6 * world, 4 * world]  # each a multiple of 2 * cp_size
        case["cu"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        case["positions"] = torch.cat([torch.arange(n) for n in lens])[None]
    else:
        case["positions"] = torch.arange(8 * world).expand(BATCH, -1)
    case["ids"] = torch.randint(3, VOCAB, case["positions"].shape, generator=g)
    case["weights"] = torch.randn(*case["ids"].shape, VOCAB, generator=g)
    return case


def _masks(model) -> tuple[list, list]:
    """Hooks that record every dropout module's mask (its output's non-zeros), in call order."""
    found, handles = [], []
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            handles.append(m.register_forward_hook(lambda mod, args, out: found.append(out.detach().ne(0))))
    return found, handles


def _forward_backward(case: dict, model, shard, extra: dict) -> dict:
    found, handles = _masks(model)
    torch.manual_seed(SEED)  # every process alike, as transformers.set_seed leaves them
    logits = model(input_ids=shard(case["ids"]), position_ids=shard(case["positions"]), **extra).logits
    loss = (logits.double() * shard(case["weights"])[..., : logits.shape[-1]].double()).sum()
    loss.backward()
    for h in handles:
        h.remove()
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads(model, zeros_for_missing=True),
            "masks": found}


def _placement(case: dict, world: int):
    cu = case["cu"].tolist()
    return place_by_length(tuple(b - a for a, b in zip(cu, cu[1:])), world)


def _on_rank(case: dict, rank: int, world: int) -> dict:
    shard, extra = case_shard(case, rank, world, hf_ring.get_context_parallel_state().layout)
    if "placed" in case["options"]:
        placement = _placement(case, world)
        assert 0 < placement.owner.count(SHARDED) < len(placement.owner), placement.describe()
        shard = lambda x: shard_placed(x, placement, rank)  # noqa: E731
    return _forward_backward(case, _model(case, "ring_flash"), shard, extra)


def _refusals(case: dict, rank: int, world: int) -> dict:
    """What every rank raises where a draw cannot be one process's: attention dropout (GPT-2's
    default), NEFTune (its noise scaled by the shard's length), a draw whose size is the rank's
    own (found after the forward), a caller's rows laid out otherwise (draws_refused, as
    hf_ring's TRL forwards set it), and generators that differ across the ranks."""
    hf_ring.setup_context_parallel(world)
    model = _model(case, "ring_flash")
    shard = lambda x: hf_ring.shard_sequence(x, world, rank)  # noqa: E731
    found = {}
    gpt2 = tiny_model(AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256),
                      "ring_flash").train()  # its default attention dropout, 0.1
    try:
        gpt2(input_ids=shard(case["ids"]), position_ids=shard(case["positions"]))
    except NotImplementedError as e:
        found["attention"] = str(e)
    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = 5.0  # as the Trainer's neftune_noise_alpha sets it
    try:
        model(input_ids=shard(case["ids"]), position_ids=shard(case["positions"]))
    except NotImplementedError as e:
        found["neftune"] = str(e)
    del embeddings.neftune_noise_alpha
    # A draw whose size is this rank's own (a count of its tokens): the generators part.
    def draw_own_count(module, args):
        torch.rand(rank + 1)

    hook = model.model.layers[0].register_forward_pre_hook(draw_own_count)
    torch.manual_seed(SEED)
    try:
        model(input_ids=shard(case["ids"]), position_ids=shard(case["positions"]))
    except ValueError as e:
        found["data_dependent"] = str(e)
    hook.remove()
    for name in ("caller", "generators"):
        torch.manual_seed(SEED + (rank if name == "generators" else 0))
        try:
            with draws_refused("rows laid out otherwise") if name == "caller" else contextlib.nullcontext():
                model(input_ids=shard(case["ids"]), position_ids=shard(case["positions"]))
        except (NotImplementedError, RuntimeError) as e:
            found[name] = f"{type(e).__name__}: {e}"
    return found


def _rank_main(rank: int, world: int, cases: dict) -> dict:
    out = {}
    for name, case in cases.items():
        layout = "stripe" if name.endswith("_stripe") else "zigzag"
        hf_ring.setup_context_parallel(world, layout=layout,
                                       placement="by_length" if "placed" in case["options"] else "sharded")
        out[name] = _on_rank(case, rank, world)
    out["refusals"] = _refusals(cases["phi"], rank, world)
    return out


_RUNS: dict[int, tuple] = {}


def _run(world: int) -> tuple:
    """One run per world size, shared by every test of this module."""
    if world not in _RUNS:
        cases = {name: _case(name, world, seed=i) for i, name in enumerate(CASES)}
        cases["phi_stripe"] = _case("phi", world, seed=99)
        _RUNS[world] = (cases, run_world(world, _rank_main, cases))
    return _RUNS[world]


def _reference(case: dict) -> dict:
    return _forward_backward(case, _model(case, "sdpa"), lambda x: x, {"use_cache": False})


def _unshard(case: dict, shards: list, layout: str) -> torch.Tensor:
    if "placed" in case["options"]:
        placement = _placement(case, len(shards))
        full = torch.empty(shards[0].shape[0], sum(placement.doc_lens), *shards[0].shape[2:], dtype=shards[0].dtype)
        for rank, shard in enumerate(shards):
            full[:, placement.local_indices(rank)] = shard
        return full
    return unshard_packed(shards, case["cu"]) if "cu" in case else hf_ring.unshard_sequence(shards, layout=layout)


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", [*CASES, "phi_stripe"])
def test_training_with_random_draws_matches_one_process(world, name):
    cases, ranks = _run(world)
    case, mine = cases[name], [r[name] for r in ranks]
    layout = "stripe" if name.endswith("_stripe") else "zigzag"
    ref = _reference(case)
    logits = _unshard(case, [m["logits"] for m in mine], layout)
    summed = {n: sum(m["grads"][n] for m in mine) for n in mine[0]["grads"]}
    largest = max(float(g.norm()) for g in ref["grads"].values())
    worst = max(float((summed[n] - g).double().norm()) / max(float(g.norm()), GRAD_FLOOR * largest)
                for n, g in ref["grads"].items())
    scale = float((ref["logits"].double() * case["weights"][..., : ref["logits"].shape[-1]].double()).abs().sum())
    found = {"logits": rel_err(logits, ref["logits"]), "loss": abs(float(sum(m["loss"] for m in mine) - ref["loss"])) / scale,
             "grad": worst}
    assert max(found.values()) <= TOL, found


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("name", ["phi", "phi_packed", "gpt2", "phi_checkpointing", "llama_token_classification",
                                  *(["llama_lora"] if HAVE_PEFT else [])])
def test_masks_are_one_process_masks(world, name):
    """Every dropout call's mask, gathered from the CP ranks and put back in order, is the
    one process's mask of that call, bitwise (not merely different on every rank)."""
    cases, ranks = _run(world)
    case, mine = cases[name], [r[name] for r in ranks]
    ref = _reference(case)["masks"]
    assert ref and all(len(m["masks"]) == len(ref) for m in mine)
    for call, mask in enumerate(ref):
        gathered = _unshard(case, [m["masks"][call] for m in mine], "zigzag")
        assert torch.equal(gathered, mask), f"dropout call {call}"
        # Not a mask of ones: the test would pass without dropout.
        assert not bool(mask.all())


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
def test_draws_that_cannot_be_one_process_draws_are_refused_on_every_rank(world):
    _, ranks = _run(world)
    for found in (r["refusals"] for r in ranks):
        assert "NotImplementedError" in found["caller"] and "rows laid out otherwise" in found["caller"]
        assert "embed_dropout" in found["caller"] or "modeling_phi" in found["caller"], found["caller"]
        assert "attention dropout 0.1" in found["attention"]
        assert "NEFTune (neftune_noise_alpha=5.0)" in found["neftune"]
        assert "generators after this forward's draws differ" in found["data_dependent"]
        assert "RuntimeError" in found["generators"] and "generators of this context-parallel group differ" \
            in found["generators"]
