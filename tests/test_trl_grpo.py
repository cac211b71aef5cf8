"""hf_ring.trl.RingGRPOTrainer / RingRLOOTrainer under context parallelism compute what one process computes.

examples/grpo_long.py (a tiny Llama learning to copy a 4-digit key, rule-checked reward,
float32, fixed seed) is run for 8 optimizer steps in these cases:

    grpo: loss_type grpo, beta 0.04 (KL against TRL's reference model, run through the ring)
    dapo: loss_type dapo (normalised by TRL's global token count), num_iterations 2 (the
          old policy's log-probabilities, importance ratios and clipping)
    rloo: TRL's RLOOTrainer, beta 0.05 (its KL penalty in the reward), num_iterations 2
    lora_bnpo: loss_type bnpo (a per-process token mean, which the CP group rescales to its
          own) with a LoRA adapter through TRL's peft_config, beta 0.04 (the reference is the
          policy with its adapter disabled, through the ring too)

grpo, dapo and rloo also with packed rollouts (--packing: padding_free=True) at cp 2 against the
same padded cp 1 run (the rows as one packed row of documents compute what the padded rows do),
rloo packed with FSDP2 (--fsdp full_shard: weights sharded over the 2 processes),
each at cp 2 on 2 processes (one CP group, `accelerate launch`; grpo with gradient
checkpointing, TRL's default) against cp 1 in this process, and (grpo, rloo: one case per
trainer, every method at cp 1 is TRL's own) cp 1 against TRL's own trainer in this process.
12 rollouts per step (3 prompts x 4 completions), so each CP rank's slice of 6 cuts a prompt's
group in two: the group-wise advantages are computed across the two ranks' rollouts.
At cp 2 the group's first rank generates all 12 completions as one process does (same seed,
same batch), so the runs sample the same completions and their logs compare step by step; in
the dapo case the group's two ranks generate them together under CP instead (the prompts
prefilled by the ring into a sharded cache, each rank sampling from its own generator), with
the same completions.

Compared: loss, grad_norm and every figure TRL logs (rewards, reward std, KL, entropy, clip
ratios, completion lengths, token counts), at every step. Equal figures after 8 AdamW steps
also mean equal gradients. Not compared: step_time (wall clock) and what measures time.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from test_trl import compare
from test_trainer_cp import ROOT, _run
from closeness import fake_cp_state

EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
STEPS = 8
# float32 on CPU; the CP run reduces the same sums in another order (over 2 shards, through the
# ring's online softmax, positions counted from 0 instead of from the left padding). A wrong mask,
# a rank's slice scored against another's rows, or a per-rank normalisation is off by 1e-2 or more;
# 1e-4 (relative above 1, absolute below) leaves room for the rounding of 8 AdamW steps.
TOL = 1e-4
COMMON = ["--max_steps", str(STEPS), "--seed", "3", "--per_device_train_batch_size", "12",
          "--num_generations", "4", "--learning_rate", "5e-3", "--disable_tqdm"]
CASES = {
    "grpo": ["--loss_type", "grpo", "--beta", "0.04"],
    "dapo": ["--loss_type", "dapo", "--num_iterations", "2"],
    "rloo": ["--algorithm", "rloo", "--beta", "0.05", "--num_iterations", "2"],
    "lora_bnpo": ["--loss_type", "bnpo", "--beta", "0.04", "--lora_r", "4"],
}
# Packed rollouts (padding_free=True) at cp 2 against the padded cp 1 run: GRPO with two loss types, and RLOO.
PACKED = {"grpo": ("--packing",), "dapo": ("--packing",), "rloo": ("--packing", "--fsdp", "full_shard")}
# At cp 1 every method is TRL's own; checked once per trainer and for the loss types with their own code paths.
AGAINST_TRL = ("grpo", "rloo")
WITH_KL = ("grpo", "rloo", "lora_bnpo")
# Gradient checkpointing (TRL's GRPOConfig default) in the CP run only: it recomputes the ring in the backward.
# dapo: the group's ranks generate its rollouts together under CP (a sharded prefill, left-padded prompts).
CP_ONLY = {"grpo": ["--gradient_checkpointing"], "dapo": ["--generate_under_cp"]}
# What each case must have logged (and compared), beyond loss and grad_norm.
EXPECTED = {"reward", "reward_std", "rewards/copy_reward/mean", "rewards/copy_reward/std", "entropy",
            "completions/mean_length", "num_tokens", "clip_ratio/region_mean", "frac_reward_zero_std"}


def _figures_only(log_history: list[dict]) -> dict:
    """The log without step_time (wall clock, which compare() would hold to 1e-4)."""
    return {"log_history": [{k: v for k, v in e.items() if k != "step_time"} for e in log_history]}


@pytest.fixture(scope="module")
def in_process_runs(tmp_path_factory):
    """(case, "trl" | "ring") -> the log of an in-process cp 1 run of the example."""
    from accelerate.state import AcceleratorState

    import hf_ring
    import grpo_long

    cache: dict[tuple[str, str], dict] = {}

    def get(case: str, which: str) -> dict:
        if (case, which) not in cache:
            out = str(tmp_path_factory.mktemp(f"{case}_{which}"))
            argv = ["--output_dir", out, *COMMON, *CASES[case]] + (["--stock_trainer"] if which == "trl" else [])
            args = grpo_long.parse_args(argv)
            try:
                config = grpo_long.rl_config(args)
                plugin = None if args.stock_trainer else hf_ring.RingAttentionPlugin()
                trainer = grpo_long.build_trainer(args, config, plugin)
                trainer.train()
                cache[(case, which)] = _figures_only(trainer.state.log_history)
            finally:
                AcceleratorState._reset_state(reset_partial_state=True)
                hf_ring.set_context_parallel_state(None)
        return cache[(case, which)]

    return get


def _launch_cp2(case: str, out_dir: str, extra: tuple[str, ...] = ()) -> dict:
    log = _run(2, [os.path.join(EXAMPLES, "grpo_long.py"), "--output_dir", out_dir, "--cp_size", "2",
                   *COMMON, *CASES[case], *CP_ONLY.get(case, []), *extra])
    assert "[hf_ring] rank 1/2 (dist_backend" in log, log[-3000:]
    if "--generate_under_cp" in CP_ONLY.get(case, []):  # the group's ranks really generated together
        assert "[hf_ring] rollouts generated under CP by the 2 ranks" in log, log[-3000:]
    if "--fsdp" in extra:  # the weights really were sharded
        assert "gradients: fsdp2 mesh (2,) over 2 processes" in log, log[-3000:]
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        return _figures_only(json.load(f)["log_history"])


def _steps(state: dict) -> list[int]:
    return sorted({e["step"] for e in state["log_history"] if "loss" in e})


@pytest.mark.parametrize("case", AGAINST_TRL)
def test_ring_trainer_at_cp1_is_trl_trainer(in_process_runs, case):
    """At cp 1 RingGRPOTrainer / RingRLOOTrainer is TRL's own: the same figures (measured: equal)."""
    ref, got = in_process_runs(case, "trl"), in_process_runs(case, "ring")
    assert _steps(ref) == list(range(1, STEPS + 1))
    worst = compare(got, ref)
    assert {"loss", "grad_norm"} | EXPECTED <= set(worst), sorted(({"loss", "grad_norm"} | EXPECTED) - set(worst))


def _check_cp2_against_cp1(in_process_runs, tmp_path, case: str, extra: tuple[str, ...] = ()) -> dict:
    """The cp 2 run of ``case`` (plus ``extra`` flags) logs what the padded cp 1 run logs;
    returns the cp 1 log."""
    ref = in_process_runs(case, "ring")
    got = _launch_cp2(case, str(tmp_path / case), extra)
    assert _steps(got) == list(range(1, STEPS + 1))
    worst = compare(got, ref)
    expected = {"loss", "grad_norm"} | EXPECTED | ({"kl"} if case in WITH_KL else set())
    assert expected <= set(worst), sorted(expected - set(worst))
    print(f"\n{case} {' '.join(extra)}: max |cp2 - cp1| per figure over {STEPS} steps: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_cp2_logs_what_cp1_logs(in_process_runs, tmp_path, case):
    ref = _check_cp2_against_cp1(in_process_runs, tmp_path, case)
    # The comparison is not one of zeros: the policy moves and is rewarded for it.
    assert any(e.get("grad_norm", 0.0) > 1e-3 for e in ref["log_history"])
    assert any(e.get("reward", 0.0) > 0.0 for e in ref["log_history"])
    if case in WITH_KL:
        assert any(abs(e.get("kl", 0.0)) > 1e-6 for e in ref["log_history"])
    if case == "lora_bnpo":  # the adapter alone was trained and saved
        assert os.path.exists(os.path.join(str(tmp_path / case), "adapter_model.safetensors"))


@pytest.mark.parametrize("case", sorted(PACKED))
def test_cp2_packed_logs_what_cp1_padded_logs(in_process_runs, tmp_path, case):
    """padding_free=True (--packing) at cp 2: the group's rows as one packed row of documents
    against TRL's padded rows at cp 1 (the same computation: documents never attend to each
    other, positions restart per document); the same tolerance. RLOO with FSDP2 too (the
    weights sharded over both processes, unsharded together for the first rank's generation)."""
    ref = _check_cp2_against_cp1(in_process_runs, tmp_path, case, PACKED[case])
    # The packed documents are not all of one length (rollouts end early from step 3 on).
    lengths = [(e["completions/min_length"], e["completions/max_length"]) for e in ref["log_history"]
               if "completions/min_length" in e]
    assert any(low < high for low, high in lengths), lengths


# ---- in one process: the pieces ----


def test_group_shuffle_is_one_permutation_of_the_group():
    """The CP ranks' shuffled slices, put side by side in the group's permutation, are the
    permutation one process draws for the whole batch (from the same RNG state)."""
    from hf_ring.training.trl.rollouts import group_shuffle

    rows = 6
    torch.manual_seed(11)
    whole = torch.randperm(2 * rows)
    kept = []
    for rank in range(2):
        state = fake_cp_state(rank, 2)
        torch.manual_seed(11)
        batch = {"x": torch.arange(rank * rows, (rank + 1) * rows), "names": [f"r{i}" for i in range(rows)],
                 "count": torch.tensor(3)}
        out = group_shuffle(state)(batch)
        assert out["count"].item() == 3 and [f"r{i - rank * rows}" for i in out["x"].tolist()] == out["names"]
        kept.append(out["x"].tolist())
    assert kept[0] == [i for i in whole.tolist() if i < rows]
    assert kept[1] == [i for i in whole.tolist() if i >= rows]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_completion_rows_give_trl_per_token_values(tmp_path, packed):
    """completion_log_probs on TRL's rows (prompts left-padded by different amounts, completions of
    different lengths) gives TRL's own fused forward's log-probs and entropies on every completion
    token (one process, a CP group of 1: the compaction and the placement back; packed: the rows
    as one row of documents through ring_flash, which keeps them apart). Tolerance 1e-5: the two
    differ only in the positions (counted from the padding or from 0), which rotary attention
    sees only as differences (measured 2.4e-7), and the order of the sums."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    import hf_ring
    from hf_ring.training.trl.completion_rows import completion_log_probs
    from hf_ring.training.trl.fused_forward import RingFusedForward

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        state = hf_ring.setup_context_parallel(1)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                             pad_token_id=0))
        model.set_attn_implementation("sdpa")
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        prompt, completion = 7, 6
        ids = torch.zeros(3, prompt + completion, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, c) in enumerate([(7, 6), (4, 2), (5, 4)]):
            ids[row, prompt - p : prompt + c] = torch.randint(1, 50, (p + c,))
            mask[row, prompt - p : prompt + c] = 1
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-completion] = -100
        ref = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        if packed:  # what padding_free requires (it reads the documents' boundaries)
            model.set_attn_implementation("ring_flash")
        ring = RingFusedForward(model, state, 0, packed=packed)
        log_probs, entropy = completion_log_probs(ring, ids, mask, completion, True)
        scored = mask[:, -completion:].bool()
        assert (log_probs - ref.log_probs[:, -completion:])[scored].abs().max() < 1e-5
        assert (entropy - ref.entropy[:, -completion:])[scored].abs().max() < 1e-5
        assert not log_probs[~scored].any()  # TRL's zeros where nothing is scored
    finally:
        hf_ring.set_context_parallel_state(None)
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("change, message", [
    ({"use_vllm": True}, "vLLM"),
    ({"loss_type": "cispo"}, "loss_type='cispo'"),
    ({"steps_per_generation": 2}, "steps_per_generation=2"),
    ({"entropy_coef": 0.1}, "entropy bonus"),
    ({"per_device_train_batch_size": 3, "num_generations": 3}, "multiple of cp_size=2"),
], ids=["vllm", "loss_type", "steps_per_generation", "entropy_bonus", "batch"])
def test_refuses_what_is_not_exact_under_cp(tmp_path, change, message):
    """Checked from the config (the same on every rank: every rank raises it)."""
    from trl import GRPOConfig

    from hf_ring.training.trl.rollout_checks import check_grpo_config

    settings = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                    num_generations=4, steps_per_generation=1)
    if "use_vllm" in change:  # GRPOConfig itself checks vLLM is installed only when it is used
        args = GRPOConfig(**settings)
        args.use_vllm = True
    else:
        args = GRPOConfig(**{**settings, **change})
    with pytest.raises((NotImplementedError, ValueError), match=message):
        check_grpo_config(args, {}, cp_size=2)
    with pytest.raises(NotImplementedError, match="tools="):
        check_grpo_config(GRPOConfig(**settings), {"tools": [len]}, cp_size=2)


def test_padding_free_refuses_attention_that_does_not_keep_documents_apart():
    """padding_free at cp 1 with SDPA: refused (it does not read the documents' boundaries)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hf_ring.trl import RingGRPOTrainer

    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    trainer = SimpleNamespace(model=SimpleNamespace(config=config), ref_model=None)
    with pytest.raises(ValueError, match="padding_free=True .* the policy uses attn_implementation='sdpa'"):
        RingGRPOTrainer._check_packing_attention(trainer)
    config._attn_implementation = "ring_flash"
    RingGRPOTrainer._check_packing_attention(trainer)
