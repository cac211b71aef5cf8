"""The HF Trainer under context parallelism computes what it computes without it.

Runs examples/finetune_llama_long.py for real, in float32 with a fixed seed, with
`accelerate launch` (processes started by torchrun underneath, gloo on CPU), and compares
the Trainer's own logs (trainer_state.json): the training loss of every step and the eval
loss. Every configuration sees the same 4 examples per optimizer step (gradient
accumulation 2), so all of them must log the same losses:

    1 process   cp 1: batch 2 x accumulation 2           (the reference, plain SDPA)
    2 processes cp 2: one CP group, batch 2 x accumulation 2 (zigzag layout, and stripe)
    2 processes dp 2: batch 1 x accumulation 2 per rank
    4 processes dp 2 x cp 2: batch 1 x accumulation 2 per CP group

The passkey data masks the prompt, so most shards hold no valid label (nothing may be NaN).
Equal losses at every step after 8 AdamW steps also mean equal gradients. A packed variant
(cp 2 against cp 1) and a resume from a checkpoint complete the picture, and ``--torch_compile``
at cp 2 (padded under DDP, packed under FSDP2) logs what the eager runs log.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from packaging.version import Version

from distributed import free_port
from subprocess_limits import HANG_GUARD_S
from tensor_parallel_loading import NEEDS_TP
import warm_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "finetune_llama_long.py")
COMPILE_DRIVER = os.path.join(ROOT, "tests", "compile_trainer_run.py")
# FSDP2 on CPU through accelerate launch needs transformers 5 (hf_ring.training.weight_sharding).
NEEDS_FSDP2 = pytest.mark.skipif(Version(transformers.__version__) < Version("5"), reason="FSDP2 needs transformers 5")
STEPS = 8
REL_TOL = 1e-4
COMMON = [
    "--seq_len", "256", "--max_steps", str(STEPS), "--seed", "3", "--gradient_accumulation_steps", "2",
    "--num_train_examples", "64", "--num_eval_examples", "8", "--eval_steps", "4",
    "--learning_rate", "1e-3", "--hidden_size", "64", "--disable_tqdm",
]


def _run(nproc: int, script: list[str], launch: tuple[str, ...] = ("--multi_gpu",)) -> str:
    """Run ``script`` (a path and its arguments) on ``nproc`` processes; return its output.
    ``launch``: accelerate launch's flags that choose how (``--multi_gpu``: on a machine
    without GPUs accelerate otherwise starts ONE process; ``--use_fsdp`` starts them too)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), *script]
    proc = warm_launch.run(cmd, env, ROOT, HANG_GUARD_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-6000:]}"
    return log


def _launch(nproc: int, out_dir: str, args: list[str], expect: tuple[str, ...] = (),
            launch: tuple[str, ...] = ("--multi_gpu",), script: str = EXAMPLE) -> dict:
    """Run the example (or ``script``, a driver around it) on ``nproc`` processes; return its
    trainer_state.json, and a driver's output under ``"_log"``. ``expect``: lines its output
    must contain (which code path ran)."""
    log = _run(nproc, [script, "--output_dir", out_dir, *COMMON, *args], launch)
    # Every process reports where it sits in the dp x cp grid: proof that nproc really ran.
    ranks = re.findall(rf"\[hf_ring\] rank (\d+)/{nproc} \(dist_backend", log)
    assert sorted(map(int, ranks)) == list(range(nproc)), log[-3000:]
    for line in expect:
        assert line in log, (line, log[-3000:])
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        state = json.load(f)
    if script != EXAMPLE:
        state["_log"] = log
    return state


def _losses(state: dict) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


def _grad_norms(state: dict) -> dict[int, float]:
    return {e["step"]: e["grad_norm"] for e in state["log_history"] if "grad_norm" in e}


def _epochs(state: dict) -> list[float]:
    return [e["epoch"] for e in state["log_history"] if "loss" in e]


def _eval_losses(state: dict) -> dict[int, float]:
    # The last entry repeats the final evaluation (trainer.evaluate() after training).
    return {e["step"]: e["eval_loss"] for e in state["log_history"] if "eval_loss" in e}


def _assert_same(got: dict[int, float], ref: dict[int, float], what: str, tol: float = REL_TOL) -> None:
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    for step, value in ref.items():
        assert math.isfinite(got[step]) and math.isfinite(value), (what, step, got[step], value)
        assert abs(got[step] - value) <= tol * abs(value), f"{what} at step {step}: {got[step]} vs {value}"


def _generation_evals(state: dict) -> dict[tuple[int, str], float]:
    return {(e["step"], k): v for e in state["log_history"] for k, v in e.items() if k.startswith("eval_passkey")}


def _assert_same_logs(got: dict, ref: dict, name: str) -> None:
    """The training loss, the norm of the (all-reduced) gradient (the gradients themselves
    match) and the eval loss of every step logged, ``got`` against ``ref``; and, where ``got``
    answered eval prompts by generation (``--generate_eval``), the same answers' figures."""
    _assert_same(_losses(got), _losses(ref), f"{name} training loss")
    _assert_same(_grad_norms(got), _grad_norms(ref), f"{name} gradient norm")
    _assert_same(_eval_losses(got), _eval_losses(ref), f"{name} eval loss")
    if _generation_evals(got):
        assert _generation_evals(got) == _generation_evals(ref), (name, _generation_evals(got), _generation_evals(ref))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch each configuration once (on demand) and keep its trainer_state.json."""
    cache: dict[str, dict] = {}
    configs = {
        # --generate_eval: at every evaluation two eval prompts answered by generation (at cp 2 under CP).
        "cp1": (1, ["--per_device_train_batch_size", "2", "--generate_eval", "2"]),
        "stock": (1, ["--stock_trainer", "--per_device_train_batch_size", "2"]),
        "cp2": (2, ["--cp_size", "2", "--per_device_train_batch_size", "2", "--save_steps", "4",
                    "--generate_eval", "2"]),
        "cp2_stripe": (2, ["--cp_size", "2", "--layout", "stripe", "--per_device_train_batch_size", "2"]),
        "dp2": (2, ["--per_device_train_batch_size", "1"]),
        "dp2_cp2": (4, ["--cp_size", "2", "--per_device_train_batch_size", "1"]),
        "packed_cp1": (1, ["--packing", "--per_device_train_batch_size", "2"]),
        "packed_cp2": (2, ["--packing", "--cp_size", "2", "--per_device_train_batch_size", "2"]),
        # Llama 3's all-gather on the packed rows: each chunk of each document against its prefix.
        "packed_cp2_allgather": (2, ["--packing", "--cp_size", "2", "--cp_pattern", "allgather",
                                     "--per_device_train_batch_size", "2"]),
        # Tensor parallelism beside CP: transformers' DistributedConfig(tp_size=2, fsdp_size=2), 4 processes.
        "tp2_cp2": (4, ["--tp_size", "2", "--cp_size", "2", "--per_device_train_batch_size", "2"]),
        # Packed, with sequence parallelism inside TP: each TP rank keeps half of its CP shard between blocks.
        "packed_tp2_cp2": (4, ["--packing", "--tp_size", "2", "--cp_size", "2", "--sequence_parallel",
                               "--per_device_train_batch_size", "2"]),
    }
    # A Qwen3-MoE with its router load-balancing loss (weight 0.5, so it moves the gradients), its
    # experts split over 2 expert-parallel ranks beside CP: DistributedConfig(ep_size=2, fsdp_size=2).
    moe = ["--moe_experts", "4", "--router_aux_loss_coef", "0.5", "--per_device_train_batch_size", "2"]
    configs.update({"moe_cp1": (1, moe), "moe_stock": (1, [*moe, "--stock_trainer"]),
                    "moe_ep2_cp2": (2, [*moe, "--cp_size", "2", "--ep_size", "2"])})
    # Packed rows: the router loss is refused there (each document's padding would count), so off.
    packed_moe = ["--moe_experts", "4", "--router_aux_loss_coef", "0", "--packing", "--per_device_train_batch_size", "2"]
    configs.update({"moe_packed_cp1": (1, packed_moe),
                    "moe_packed_ep2_cp2": (2, [*packed_moe, "--cp_size", "2", "--ep_size", "2"])})
    # The sizes the Accelerate way: accelerate launch's parallelism config (it asks for FSDP2 with
    # one), no --cp_size; hf_ring runs the CP, torch's is not engaged.
    configs["launch_cp2"] = (2, ["--per_device_train_batch_size", "2"])
    launch = {"launch_cp2": ("--use_fsdp", "--fsdp_version", "2", "--use_parallelism_config",
                             "--parallelism_config_cp_size", "2")}
    # Your own documents (--train_file): a long-tail length mix (examples/make_length_mix.py) plus one
    # document longer than --seq_len, packed whole; 4 of the 41 documents held out for eval_loss.
    mix = _own_documents(str(tmp_path_factory.mktemp("own_documents") / "mix.jsonl"))
    own = ["--train_file", mix, "--eval_share", "0.1", "--packing", "--per_device_train_batch_size", "2"]
    configs.update({"file_cp1": (1, own), "file_cp2": (2, [*own, "--cp_size", "2"])})
    # A long-tail mix of the user's own documents (--train_file, examples/make_length_mix.py), rows
    # of 6 packed and placed by length: the long document sharded, the short ones whole on a rank.
    mix = str(tmp_path_factory.mktemp("mix") / "mix.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_length_mix.py"), "--out", mix,
                    "--seq_len", "512", "--num_docs", "96"], check=True, capture_output=True)
    on_mix = ["--seq_len", "512", "--train_file", mix, "--eval_share", "0.1", "--packing",
              "--per_device_train_batch_size", "6"]
    by_length = ["--cp_placement", "by_length"]
    configs.update({"mix_cp1": (1, on_mix),
                    "mix_cp2_by_length": (2, [*on_mix, *by_length, "--cp_size", "2"]),
                    "mix_tp2_cp2_by_length": (4, [*on_mix, *by_length, "--cp_size", "2", "--tp_size", "2"]),
                    "mix_cp2_auto": (2, [*on_mix, "--cp_placement", "auto", "--cp_size", "2"])})
    # --torch_compile (aot_eager: inductor's graphs without its code generation, ~10 s a compile
    # on 2 cores; tests/test_compile_cp.py runs inductor) through tests/compile_trainer_run.py,
    # which fails a run that dynamo recompiles past its limit and reports the custom ops' calls.
    # Packed at cp 2 beside FSDP2, compiled layer by layer (the example's --fsdp sets it).
    compile_flags = ["--torch_compile", "--torch_compile_backend", "aot_eager", "--per_device_train_batch_size", "2"]
    configs.update({"compiled_cp1": (1, compile_flags), "compiled_cp2": (2, [*compile_flags, "--cp_size", "2"]),
                    "compiled_packed_cp2_fsdp": (2, [*compile_flags, "--packing", "--cp_size", "2",
                                                     "--fsdp", "full_shard"])})
    scripts = {name: COMPILE_DRIVER for name in configs if name.startswith("compiled_")}
    # What proves the run took the path it names (beside the ranks every launch checks).
    # Beside TP the loss is chunked on each TP rank's vocabulary rows (memory/vocab_parallel.py).
    expect = {name: ("gradients: fsdp2 mesh (2,) over 2 processes", "cp_rank 1/2, tp_rank 1/2",
                     "chunked loss on (weights sharded by: fsdp2, the vocabulary's rows over tp 2)")
              for name in ("tp2_cp2", "packed_tp2_cp2")}
    expect["packed_tp2_cp2"] += ("sequence parallelism inside TP: 2 decoder layers keep 1/2 of each rank's tokens",)
    expect["moe_ep2_cp2"] = ("experts over ep_size 2", "gradients: fsdp2 mesh (2,) over 2 processes")
    expect["packed_cp2_allgather"] = ("cp_rank 1/2, layout zigzag, pattern allgather",)
    placed = ("kernel auto, placement by_length", "over 2 ranks: 1 sharded")
    expect["mix_cp2_by_length"] = placed
    expect["mix_tp2_cp2_by_length"] = (*placed, "gradients: fsdp2 mesh (2,) over 2 processes", "tp_rank 1/2")
    expect["mix_cp2_auto"] = ("kernel auto, placement auto", "[hf_ring] placement auto: ")
    expect["launch_cp2"] = ("gradients: fsdp2 mesh (2,) over 2 processes", "cp_rank 1/2, layout zigzag")
    expect["compiled_cp2"] = ("gradients: ddp over 2 processes", "chunked loss on (weights sharded by: none)")
    expect["compiled_packed_cp2_fsdp"] = ("gradients: fsdp2 mesh (2,) over 2 processes",
                                          "chunked loss on (weights sharded by: fsdp2)")
    for name in ("file_cp1", "file_cp2"):
        expect[name] = ("37 documents, ", "truncated to --seq_len 256; eval: 4 documents")

    def get(name: str) -> dict:
        if name not in cache:
            nproc, args = configs[name]
            out = str(tmp_path_factory.mktemp(name))
            cache[name] = _launch(nproc, out, args, expect.get(name, ()), launch.get(name, ("--multi_gpu",)),
                                  scripts.get(name, EXAMPLE))
            cache[name]["_output_dir"] = out
        return cache[name]

    return get


def test_reference_trains_and_is_finite(runs):
    ref = runs("cp1")
    losses = _losses(ref)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1]  # it learns
    assert ref["global_step"] == STEPS
    assert ref["train_batch_size"] == 2
    # Two prompts answered at each evaluation (steps 4 and 8); cp2 must answer them alike.
    assert {step for step, _ in _generation_evals(ref)} == {4, STEPS}


@pytest.mark.parametrize("name", ["cp2", "cp2_stripe", "dp2", "dp2_cp2", pytest.param("tp2_cp2", marks=NEEDS_TP),
                                  pytest.param("launch_cp2", marks=NEEDS_FSDP2)])
def test_same_losses_as_without_cp(runs, name):
    ref, got = runs("cp1"), runs(name)
    _assert_same_logs(got, ref, name)
    assert got["global_step"] == STEPS
    # Epoch bookkeeping counts data-parallel ranks only (CP ranks share their batches).
    assert _epochs(got) == pytest.approx(_epochs(ref))


@NEEDS_TP
def test_tp2_cp2_logs_what_the_stock_trainer_logs(runs):
    """The stock transformers Trainer on one process (the model's own loss, SDPA) as the reference."""
    ref, got = runs("stock"), runs("tp2_cp2")
    _assert_same_logs(got, ref, "tp2_cp2 vs stock")


@NEEDS_TP
def test_moe_with_experts_split_beside_cp_logs_what_one_process_logs(runs):
    """ep2 x cp2 on 2 processes against the same MoE at cp1 on one process, and that against the
    stock Trainer (the model's own loss: cross-entropy + 0.5 x its load-balancing loss)."""
    ref, stock, got = runs("moe_cp1"), runs("moe_stock"), runs("moe_ep2_cp2")
    _assert_same_logs(got, ref, "moe_ep2_cp2")
    _assert_same_logs(ref, stock, "moe_cp1 vs stock")


@NEEDS_TP
def test_packed_moe_with_experts_split_beside_cp_logs_what_one_process_logs(runs):
    ref, got = runs("moe_packed_cp1"), runs("moe_packed_ep2_cp2")
    _assert_same_logs(got, ref, "moe_packed_ep2_cp2")


def _own_documents(path: str) -> str:
    """A JSON lines file of 40 documents of the long-tail mix for rows of 256 tokens, and one of
    300 tokens (truncated to 256 by the example); returns ``path``."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from make_length_mix import document, write_length_mix
    import random

    lengths = write_length_mix(path, num_docs=40, seq_len=256, seed=1)
    assert sum(n < 256 // 8 for n in lengths) >= 30 and max(lengths) >= 128, lengths  # the mix's stated shape
    with open(path, "a") as f:
        f.write(json.dumps({"text": document(random.Random(0), 300)}) + "\n")
    return path


def test_own_documents_at_cp2_log_what_cp1_logs(runs):
    """``--train_file`` (JSON lines, documents packed whole, one truncated to --seq_len) with
    ``--eval_share``: cp 2 logs the loss, gradient norm and eval_loss that cp 1 logs."""
    ref = runs("file_cp1")
    assert _eval_losses(ref) and len(_losses(ref)) == STEPS, ref["log_history"]
    _assert_same_logs(runs("file_cp2"), ref, "own documents, cp 2")


@pytest.mark.parametrize("name", ["packed_cp2", "packed_cp2_allgather", pytest.param("packed_tp2_cp2", marks=NEEDS_TP)])
def test_packed_same_losses_as_without_cp(runs, name):
    ref, got = runs("packed_cp1"), runs(name)
    _assert_same_logs(got, ref, name)


@pytest.mark.parametrize("name", ["mix_cp2_by_length", pytest.param("mix_tp2_cp2_by_length", marks=NEEDS_TP),
                                  "mix_cp2_auto"])
def test_rows_placed_by_length_log_what_cp1_logs(runs, name):
    """A long-tail mix from --train_file, packed and placed by length (a row's long document
    over the CP group, its short ones whole on one rank each; the plan is in the log), or by
    ``auto`` (per row, that plan or every document sharded; its choice is in the log)."""
    ref, got = runs("mix_cp1"), runs(name)
    _assert_same_logs(got, ref, name)
    assert any("eval_loss" in e for e in got["log_history"])


def _compile_reports(state: dict, nproc: int) -> list[dict]:
    reports = re.findall(r"\[compile_trainer_run\] rank (\d+): (\{.*?\})", state["_log"])
    assert sorted(int(rank) for rank, _ in reports) == list(range(nproc)), state["_log"][-3000:]
    return [json.loads(report) for _, report in reports]


# compiled run at cp 2: (the eager run at cp 2, the run at cp 1) it must log. The compiled cp 1
# run is launched for padded rows only (~30 s a compiled launch); packed, cp 1 is the eager run.
COMPILED = {"compiled_cp2": ("cp2", "compiled_cp1"), "compiled_packed_cp2_fsdp": ("packed_cp2", "packed_cp1")}


# FSDP2 through TrainingArguments needs transformers 5; the padded run, like tests/test_compile_cp.py,
# runs on the newest leg only (the oldest leg's share of the budget: ~1 minute a compiled launch there).
@pytest.mark.skipif(Version(transformers.__version__) < Version("5"),
                    reason="torch.compile under CP is checked on the newest leg (FSDP2 there needs transformers 5)")
@pytest.mark.parametrize("name", list(COMPILED))
def test_torch_compile_at_cp2_logs_what_eager_cp2_and_compiled_cp1_log(runs, name):
    """--torch_compile at cp 2 (TrainingArguments(torch_compile=True) in RingTrainer, under DDP on
    padded rows, under FSDP2 on packed ones, the chunked loss on): 8 steps' training loss, gradient
    norm and eval loss within 1e-4 (the Trainer parity tolerance) of the eager cp 2 run's and of
    the cp 1 run's. Not a run that fell back to eager: every training forward ran the ring's op
    in each of the 2 attention layers and the chunked loss's op once (eager forwards call
    neither), and no frame was recompiled past dynamo's limit (the driver fails the run then)."""
    eager, cp1 = COMPILED[name]
    got = runs(name)
    _assert_same_logs(got, runs(eager), f"{name} against {eager}")
    _assert_same_logs(got, runs(cp1), f"{name} against {cp1}")
    forwards = STEPS * 2  # gradient accumulation 2; under FSDP2 the evaluations run compiled too
    for report in _compile_reports(got, 2):
        assert report["steps"] == STEPS and report["loss_op_calls"] >= forwards, report
        assert report["ring_op_calls"] == 2 * report["loss_op_calls"], report
    if cp1.startswith("compiled_"):
        for report in _compile_reports(runs(cp1), 1):  # sdpa, unchunked: dynamo compiled graphs
            assert report["steps"] == STEPS and report["graphs"] >= 1 and report["ring_op_calls"] == 0, report


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5"),
    reason="transformers 4.x resumes a multi-process run with torch.load(map_location=args.device), "
    "which is 'cpu:0' on CPU and which torch cannot restore; any DDP run on CPU fails there, CP or not",
)
def test_resume_from_checkpoint(runs, tmp_path):
    """Resuming the CP run from its step-4 checkpoint logs the same steps 5-8."""
    full = runs("cp2")
    checkpoint = os.path.join(full["_output_dir"], "checkpoint-4")
    assert os.path.isdir(checkpoint), os.listdir(full["_output_dir"])
    resumed = _launch(2, str(tmp_path / "resumed"), [
        "--cp_size", "2", "--per_device_train_batch_size", "2", "--resume_from_checkpoint", checkpoint,
    ])
    later = {s: v for s, v in _losses(full).items() if s > 4}
    _assert_same({s: v for s, v in _losses(resumed).items() if s > 4}, later, "resumed training loss")


GENERATE = os.path.join(ROOT, "examples", "generate_long.py")


def test_generation_from_the_examples_final_model_is_one_process_generation(runs):
    """The cp 2 run's final model (saved in its --output_dir at the end) answers the passkey
    prompt under CP with examples/generate_long.py at cp 2 (greedy, the processes' generators
    apart as torch seeds them) as one process answers it: the tokens compared here, against
    the model reloaded with sdpa in this process, and on the first rank by the example."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from long_context_data import ByteTokenizer, passkey_example
    import random

    out_dir = runs("cp2")["_output_dir"]
    assert os.path.isfile(os.path.join(out_dir, "config.json")), os.listdir(out_dir)
    log = _run(2, [GENERATE, "--cp_size", "2", "--model_name_or_path", out_dir, "--prompt_tokens", "256",
                   "--max_new_tokens", "8"])
    reports = re.findall(r"\[rank (\d)\] (\{.*\})", log)
    assert sorted(int(r) for r, _ in reports) == [0, 1], log[-3000:]
    tokenizer = ByteTokenizer()
    example = passkey_example(tokenizer, random.Random(0), 256)  # generate_long's prompt at --seed 0
    prompt_ids = [t for t, label in zip(example["input_ids"], example["labels"]) if label == -100]
    prompt = torch.tensor([prompt_ids])
    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               use_cache=True)[0, prompt.shape[1]:].tolist()
    for rank, report in reports:
        assert f"'new_token_ids': {alone}" in report, (rank, alone, report)
    assert "'same_as_one_process': True" in dict(reports)["0"], reports


# ---- in-process checks of the loss and of the errors (no launch) ----


@pytest.fixture
def fresh_process_state():
    """Leave no Accelerate state nor active context-parallel state behind for other tests."""
    from accelerate.state import AcceleratorState

    import hf_ring

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    hf_ring.set_context_parallel_state(None)


def test_the_example_evaluates_the_last_step_once(tmp_path, fresh_process_state):
    """3 steps with an evaluation every 2: evaluated at steps 2 and 3, each once, whether the
    Trainer evaluates at the end itself (transformers 5) or the example does (4.57)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune_llama_long

    metrics = finetune_llama_long.main(["--output_dir", str(tmp_path), "--seq_len", "256", "--max_steps", "3",
                                        "--eval_steps", "2", "--num_train_examples", "8", "--num_eval_examples", "2",
                                        "--hidden_size", "32", "--cp_size", "1", "--disable_tqdm"])
    with open(tmp_path / "trainer_state.json") as f:
        evaluated = [e["step"] for e in json.load(f)["log_history"] if "eval_loss" in e]
    assert evaluated == [2, 3], evaluated
    assert math.isfinite(metrics["eval_loss"]), metrics


def test_loss_shares_add_up_to_the_token_mean_and_its_gradient():
    import torch.nn.functional as F

    from hf_ring.training.loss import count_valid_tokens, loss_share, token_loss_sum
    from hf_ring.sharding import shard_sequence

    torch.manual_seed(0)
    logits = torch.randn(2, 16, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 16))
    labels[:, :13] = -100  # only the end is learned: some shards hold no valid label
    full = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    (grad_full,) = torch.autograd.grad(full, logits)

    cp = 4
    count = int(count_valid_tokens(labels))
    shares = []
    for r in range(cp):
        local_logits = shard_sequence(logits, cp, r)
        local_labels = shard_sequence(labels, cp, r)
        share = loss_share(token_loss_sum(local_logits, local_labels), count)
        assert torch.isfinite(share)
        shares.append(share)
    assert [int(count_valid_tokens(shard_sequence(labels, cp, r))) == 0 for r in range(cp)].count(True) >= 2
    total = torch.stack(shares).sum()
    (grad_cp,) = torch.autograd.grad(total, logits)
    assert torch.allclose(total.double(), full, rtol=1e-6)
    assert torch.allclose(grad_cp, grad_full, rtol=1e-6, atol=1e-9)


def test_loss_without_any_valid_token_is_zero_not_nan():
    from hf_ring.training.loss import loss_share, token_loss_sum

    logits = torch.randn(1, 8, 5, requires_grad=True)
    labels = torch.full((1, 8), -100)
    share = loss_share(token_loss_sum(logits, labels), 0)
    share.backward()
    assert share.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_plugin_refuses_a_world_that_cp_size_does_not_divide(fresh_process_state):
    from hf_ring import RingAttentionPlugin

    with pytest.raises(ValueError, match="cp_size"):
        RingAttentionPlugin(cp_size=0)
    with pytest.raises(ValueError, match="layout"):
        RingAttentionPlugin(cp_size=2, layout="diagonal")
    for bad in (0, -1.0, "600", True):
        with pytest.raises(ValueError, match="timeout must be"):
            RingAttentionPlugin(cp_size=2, timeout=bad)
    # pytest is one process: cp_size 2 cannot be served, and the error says how to launch.
    with pytest.raises(ValueError, match="--multi_gpu"):
        RingAttentionPlugin(cp_size=2).setup()


def test_trainer_refuses_what_it_cannot_do_exactly(tmp_path, fresh_process_state):
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from hf_ring import RingAttentionPlugin, RingDataCollator, RingTrainer

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    plugin = RingAttentionPlugin(cp_size=1)
    with pytest.raises(ValueError, match="compute_loss_func"):
        RingTrainer(model=model, args=args, ring_plugin=plugin, data_collator=plugin.make_collator(0),
                    compute_loss_func=lambda *a, **k: torch.tensor(0.0))
    with pytest.raises(ValueError, match="make_collator"):
        RingTrainer(model=model, args=args, ring_plugin=plugin, data_collator=RingDataCollator(0, cp_size=2))
    trainer = RingTrainer(model=model, args=args, ring_plugin=plugin, data_collator=plugin.make_collator(0))
    with pytest.raises(ValueError, match="shift_labels"):
        trainer.compute_loss(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4)})


def _save_tiny_checkpoint(path: str, bare: str) -> None:
    """A Llama checkpoint with a real (byte-level BPE, no merges) HF tokenizer, as a user's
    ``--model_name_or_path`` would be; its config keeps ``use_cache=True``, as real ones do.
    ``bare``: the same weights without a tokenizer beside them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<pad>", "<s>", "</s>"):
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    model.save_pretrained(bare)


def test_pretrained_checkpoint_with_its_tokenizer(tmp_path):
    """cp 1 reads the checkpoint's own tokenizer; cp 2 a checkpoint without one, given the
    tokenizer with --tokenizer_name: the same figures."""
    checkpoint, bare = str(tmp_path / "tiny-llama"), str(tmp_path / "tiny-llama-bare")
    _save_tiny_checkpoint(checkpoint, bare)
    common = ["--max_steps", "3", "--eval_steps", "3", "--per_device_train_batch_size", "2"]
    ref = _launch(1, str(tmp_path / "cp1"), ["--model_name_or_path", checkpoint, *common])
    got = _launch(2, str(tmp_path / "cp2"), ["--cp_size", "2", "--model_name_or_path", bare,
                                             "--tokenizer_name", checkpoint, *common])
    _assert_same(_losses(got), _losses(ref), "training loss")
    _assert_same(_eval_losses(got), _eval_losses(ref), "eval loss")


def test_passkey_data_learns_only_the_answer():
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    from long_context_data import ByteTokenizer, passkey_dataset

    tok = ByteTokenizer()
    data = passkey_dataset(tok, num_examples=4, max_tokens=300, seed=0)
    for row in data:
        ids, labels = row["input_ids"], row["labels"]
        assert 300 // 2 <= len(ids) <= 300 and len(labels) == len(ids)
        learned = [t for t in labels if t != -100]
        answer = tok.decode(learned)
        key = answer.strip(" .")
        assert key.isdigit() and len(key) == 5
        assert labels[: len(ids) - len(learned)] == [-100] * (len(ids) - len(learned))  # the prompt is masked
        assert tok.decode(ids[: len(ids) - len(learned)]).count(key) == 2  # hidden once (said twice), asked at the end


def test_custom_accelerate_loop_gradients_equal_without_cp(tmp_path):
    """The plugin's documented custom loop: same losses and the same first gradient
    (after DDP's average over the 2 processes) at cp 2 as in one process."""
    script = os.path.join(ROOT, "tests", "ring_custom_loop.py")
    results = {}
    for cp in (1, 2):
        out = str(tmp_path / f"cp{cp}.json")
        _run(cp, [script, str(cp), out])
        with open(out) as f:
            results[cp] = json.load(f)
    ref, got = results[1], results[2]
    assert len(got["losses"]) == len(ref["losses"]) == 4
    _assert_same(dict(enumerate(got["losses"])), dict(enumerate(ref["losses"])), "custom loop loss")
    g_ref, g_cp = torch.tensor(ref["first_grad"]), torch.tensor(got["first_grad"])
    assert torch.allclose(g_cp, g_ref, rtol=1e-4, atol=1e-6), (g_cp - g_ref).abs().max()
