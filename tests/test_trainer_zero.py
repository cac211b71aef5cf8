"""DeepSpeed ZeRO under context parallelism computes what one process computes.

Runs examples/finetune_llama_long.py for real (through tests/zero_trainer_run.py, which also
saves the first optimizer step's whole parameters and gradient), float32, fixed seed, the
same 4 examples per optimizer step everywhere (gradient accumulation 2):

    1 process, no DeepSpeed: batch 2 x accumulation 2          (the reference)
    ZeRO-3, cp 2 (2 processes, torchrun): batch 2 x accumulation 2, checkpoint at step 4
    ZeRO-3, dp 2 x cp 2 (4 processes, accelerate launch): batch 1 x accumulation 2
    ZeRO-2, cp 2 (2 processes, accelerate launch)
    ZeRO-3, cp 2 resumed from the step-4 checkpoint
    ZeRO-3, cp 2, and 1 process, with the LM head tied to the input embeddings

with the chunked LM-head loss on under CP (the default; under ZeRO-3 it runs inside the
head's call, where DeepSpeed's hooks have gathered the weight, and gathers it again for its
backward), and compares the loss, the gradient norm and the eval loss at every step, the initial
weights (the same --seed under DeepSpeed as without), and every parameter's gradient of the
first step. Each run must also prove it really ran DeepSpeed at the stage asked for, with
ZeRO-3's parameters partitioned over every process, and that DeepSpeed built no C++ op.
The step-4 ZeRO-3 checkpoint (written at cp 2) is loaded into a plain one-process model
whose eval loss must be the run's.

Tolerance 1e-4 (relative) on the logged figures, as in test_trainer_cp.py: float32 sums
in another order (ring merge, ZeRO's reduce-scatter) differ by ~1e-6 relative after 8
AdamW steps. Gradients: rtol 1e-4 with atol 1e-6 (entries near zero carry absolute
float32 rounding of the ~1e-1 sized ones).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import torch
from distributed import free_port
from test_trainer_cp import COMMON, REL_TOL, STEPS  # the same runs as the DDP parity tests
from subprocess_limits import HANG_GUARD_S
import warm_launch

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "finetune_llama_long.py")
RUNNER = os.path.join(ROOT, "tests", "zero_trainer_run.py")
ZERO3 = os.path.join(ROOT, "examples", "ds_zero3.json")
ZERO2 = os.path.join(ROOT, "examples", "ds_zero2.json")
ACCELERATE_DEEPSPEED = os.path.join(ROOT, "examples", "accelerate_deepspeed.yaml")


def _command(nproc: int, launcher: str, script: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, *script]
    if launcher == "accelerate_deepspeed":  # the DeepSpeed settings from accelerate's config file
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ACCELERATE_DEEPSPEED,
                "--num_processes", str(nproc), "--main_process_port", str(free_port()), *script]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), *script]
    # --multi_gpu: on a machine without GPUs accelerate otherwise starts ONE process.
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), *script]


def _launch(nproc: int, out_dir: str, args: list[str], launcher: str = "accelerate") -> dict:
    """Run the example on ``nproc`` processes; return its trainer_state.json, the first
    step's dump and what the ranks said about their DeepSpeed engine."""
    dump = os.path.join(out_dir, "first_step.pt")
    extensions = os.path.join(out_dir, "torch_extensions")
    os.makedirs(extensions, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", TORCH_EXTENSIONS_DIR=extensions)
    cmd = _command(nproc, launcher, [RUNNER, dump, "--output_dir", out_dir, *COMMON, *args])
    proc = warm_launch.run(cmd, env, ROOT, HANG_GUARD_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-6000:]}"
    ranks = re.findall(rf"\[hf_ring\] rank (\d+)/{nproc} \(dist_backend", log)
    assert sorted(map(int, ranks)) == list(range(nproc)), log[-3000:]
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        state = json.load(f)
    engines = re.findall(
        r"\[hf_ring\] rank (\d+): DeepSpeed engine, ZeRO stage (\d+): (\d+)/(\d+) parameters partitioned, "
        r"this rank holds (\d+) of (\d+) parameter elements; train_batch_size (\d+)", log)
    return {
        "state": state,
        "dump": torch.load(dump, weights_only=True),
        "engines": {int(r): tuple(map(int, rest)) for r, *rest in engines},
        "built": sorted(os.listdir(extensions)),
        "output_dir": out_dir,
        "log": log,
    }


def _by_step(state: dict, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in state["log_history"] if key in e}


def _max_rel_diff(got: dict[int, float], ref: dict[int, float], what: str) -> float:
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    worst = 0.0
    for step, value in ref.items():
        assert math.isfinite(got[step]) and math.isfinite(value), (what, step, got[step], value)
        worst = max(worst, abs(got[step] - value) / abs(value))
    return worst


def _assert_same_run(got: dict, ref: dict, name: str, steps: int = STEPS) -> None:
    for key in ("loss", "grad_norm", "eval_loss"):
        g = {s: v for s, v in _by_step(got["state"], key).items() if s > STEPS - steps}
        r = {s: v for s, v in _by_step(ref["state"], key).items() if s > STEPS - steps}
        worst = _max_rel_diff(g, r, f"{name} {key}")
        print(f"{name}: max relative |difference| of {key} over steps {sorted(r)}: {worst:.2e}")
        assert worst <= REL_TOL, f"{name} {key}: {worst}"


def _assert_same_tensors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], name: str, what: str) -> None:
    assert sorted(got) == sorted(ref), (name, what)
    worst = max(float((got[k].float() - ref[k].float()).abs().max()) for k in ref)
    print(f"{name}: max |difference| of the first step's {what}: {worst:.2e}")
    for k in ref:
        assert got[k].shape == ref[k].shape, (name, what, k)
        assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-4, atol=1e-6), (name, what, k, worst)


def _assert_deepspeed(run: dict, nproc: int, stage: int) -> None:
    """Every rank ran a DeepSpeed engine at ``stage``; ZeRO-3 partitions every parameter
    over all ``nproc`` processes; no C++ op was built."""
    assert sorted(run["engines"]) == list(range(nproc)), run["log"][-3000:]
    for rank, (got_stage, partitioned, params, local, total, batch) in run["engines"].items():
        assert got_stage == stage, (rank, got_stage)
        # 4 examples per optimizer step in every configuration: DeepSpeed counts dp ranks only.
        assert batch == 4, (rank, batch)
        if stage == 3:
            assert partitioned == params > 0
            # Each rank holds its 1/nproc share (each parameter padded to a multiple of nproc).
            assert total / nproc <= local < total / nproc + params * nproc, (rank, local, total)
        else:
            assert partitioned == 0 and local == total
    assert run["built"] == [], f"DeepSpeed built C++ ops: {run['built']}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[str, dict] = {}
    configs = {
        "reference": (1, "python", ["--per_device_train_batch_size", "2"]),
        "zero3_cp2": (2, "torchrun", ["--deepspeed", ZERO3, "--cp_size", "2", "--per_device_train_batch_size", "2",
                                      "--save_steps", "4"]),
        "zero3_dp2_cp2": (4, "accelerate", ["--deepspeed", ZERO3, "--cp_size", "2",
                                            "--per_device_train_batch_size", "1"]),
        "zero2_cp2": (2, "accelerate", ["--deepspeed", ZERO2, "--cp_size", "2", "--per_device_train_batch_size", "2"]),
        "reference_tied": (1, "python", ["--per_device_train_batch_size", "2", "--tie_word_embeddings"]),
        "zero3_cp2_tied": (2, "torchrun", ["--deepspeed", ZERO3, "--cp_size", "2", "--per_device_train_batch_size",
                                           "2", "--tie_word_embeddings"]),
    }

    def get(name: str) -> dict:
        if name not in cache:
            nproc, launcher, args = configs[name]
            cache[name] = _launch(nproc, str(tmp_path_factory.mktemp(name)), args, launcher)
        return cache[name]

    return get


@pytest.mark.parametrize("name,nproc,stage", [
    ("zero3_cp2", 2, 3),
    ("zero3_dp2_cp2", 4, 3),
    ("zero2_cp2", 2, 2),
])
def test_zero_same_as_one_process(runs, name, nproc, stage):
    ref, got = runs("reference"), runs(name)
    _assert_deepspeed(got, nproc, stage)
    # The chunked loss ran (on by default under CP): no forward returned full logits; the
    # one-process reference's did.
    assert got["dump"]["logits_widths"] == [0], got["dump"]["logits_widths"]
    assert ref["dump"]["logits_widths"] == [ref["dump"]["params"]["lm_head.weight"].shape[0]]
    assert "[hf_ring] chunked loss on (weights sharded by: deepspeed)" in got["log"], got["log"][-3000:]
    _assert_same_run(got, ref, name)
    _assert_same_tensors(got["dump"]["params"], ref["dump"]["params"], name, "initial weights")
    _assert_same_tensors(got["dump"]["grads"], ref["dump"]["grads"], name, "gradient")
    # The Trainer's epoch bookkeeping counts data-parallel ranks only.
    assert [e["epoch"] for e in got["state"]["log_history"] if "loss" in e] == pytest.approx(
        [e["epoch"] for e in ref["state"]["log_history"] if "loss" in e])


def test_zero3_tied_embeddings_same_as_one_process(runs):
    """The chunked loss under ZeRO-3 on a head that is the input embeddings' weight: its
    gradient from the loss (computed inside the head's call, the weight gathered again for
    the backward) and from the embedding lookup must add up as in one process."""
    ref, got = runs("reference_tied"), runs("zero3_cp2_tied")
    _assert_deepspeed(got, 2, 3)
    assert "lm_head.weight" not in ref["dump"]["params"]  # one parameter, named once: the embeddings'
    assert got["dump"]["logits_widths"] == [0], got["dump"]["logits_widths"]
    assert "[hf_ring] chunked loss on (weights sharded by: deepspeed)" in got["log"], got["log"][-3000:]
    _assert_same_run(got, ref, "zero3_cp2_tied")
    _assert_same_tensors(got["dump"]["params"], ref["dump"]["params"], "zero3_cp2_tied", "initial weights")
    _assert_same_tensors(got["dump"]["grads"], ref["dump"]["grads"], "zero3_cp2_tied", "gradient")


def test_zero3_resume_from_checkpoint(runs, tmp_path):
    full = runs("zero3_cp2")
    checkpoint = os.path.join(full["output_dir"], "checkpoint-4")
    # Launched from accelerate's DeepSpeed config file (ZeRO-3 from examples/ds_zero3.json).
    resumed = _launch(2, str(tmp_path / "resumed"), [
        "--cp_size", "2", "--per_device_train_batch_size", "2", "--resume_from_checkpoint", checkpoint,
    ], launcher="accelerate_deepspeed")
    _assert_deepspeed(resumed, 2, 3)
    _assert_same_run(resumed, full, "zero3_cp2 resumed at step 4", steps=STEPS - 4)


def test_zero3_checkpoint_loads_into_one_process_model(runs):
    """The step-4 checkpoint of the ZeRO-3 cp 2 run holds the whole weights
    (stage3_gather_16bit_weights_on_model_save; float32 here, as trained): loaded into a plain
    model in this one process, its eval loss is the run's eval loss at step 4."""
    from transformers import AutoModelForCausalLM

    from hf_ring.training.collator import RingDataCollator
    from hf_ring.training.loss import count_valid_tokens, token_loss_sum

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from long_context_data import ByteTokenizer, passkey_dataset

    run = runs("zero3_cp2")
    checkpoint = os.path.join(run["output_dir"], "checkpoint-4")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa", dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == run["engines"][0][4]  # every element, none partitioned
    tokenizer = ByteTokenizer()
    args = dict(zip(COMMON[::2], COMMON[1::2]))
    # The example's eval set: --num_eval_examples examples, seed + 1.
    eval_set = passkey_dataset(tokenizer, int(args["--num_eval_examples"]), int(args["--seq_len"]),
                               seed=int(args["--seed"]) + 1)
    collate = RingDataCollator(tokenizer.pad_token_id, cp_size=1)
    means = []  # the stock Trainer's eval_loss: the mean over examples of their batch's token mean
    with torch.no_grad():
        for example in eval_set:  # per_device_eval_batch_size 1, as the run
            batch = collate([example])
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            means.append(float(token_loss_sum(logits, batch["shift_labels"]))
                         / int(count_valid_tokens(batch["shift_labels"])))
    expected = sum(means) / len(means)
    logged = _by_step(run["state"], "eval_loss")[4]
    print(f"zero3_cp2 checkpoint-4 in one process: eval loss {expected} vs logged {logged}, "
          f"relative |difference| {abs(expected - logged) / logged:.2e}")
    assert abs(expected - logged) <= REL_TOL * logged
