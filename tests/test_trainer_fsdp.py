"""Weights sharded with FSDP2 under context parallelism train exactly what one process trains.

Runs examples/finetune_llama_long.py (through tests/fsdp_trainer_run.py, which also records
the initial weights and the first step's full gradient) in float32 with a fixed seed, on
CPU with gloo, and compares against one process without CP on the same global batches
(4 examples per optimizer step, as in tests/test_trainer_cp.py):

    ref        1 process, batch 2 x accumulation 2, sdpa
    ddp_cp2    torchrun, 2 processes, cp 2, DDP               (initial weights only)
    fsdp_cp2   accelerate launch examples/accelerate_fsdp_cpu.yaml, cp 2, FSDP2 full shard,
               sharded checkpoint at step 4
    hsdp       accelerate launch (same config, 4 processes) --fsdp hybrid_shard: dp 2 x cp 2,
               mesh (replicate 2, shard 2)
    multinode  two torchrun "nodes" of 2 processes on 127.0.0.1 (--nnodes 2), --fsdp
               full_shard, dp 2 x cp 2, each CP group inside one node
    resumed    torchrun, cp 2, --fsdp full_shard, resumed from fsdp_cp2's step-4 checkpoint

Under CP the chunked LM-head loss is on (the default): the loss runs inside the head's
call, with the weight FSDP2 unsharded for the root's forward; each run's logits are checked
empty. Compared at every step: training loss, gradient norm, eval loss (relative 1e-4, the
Trainer parity tolerance; measured ~1e-7, float32 sums in another order); the first
optimizer step's full gradient (relative norm of the difference 1e-4; measured ~5e-7);
the initial weights (bit-identical: every rank builds the model from the same seed and
FSDP2 only cuts it into shards). The losses alone would not do: a gradient 4x off matched
the loss to 7.5e-7 under AdamW.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from test_trainer_cp import COMMON, EXAMPLE, ROOT, STEPS, _assert_same, _eval_losses, _grad_norms, _losses

from closeness import grads_rel_err
from distributed import free_port, run_world
from subprocess_limits import HANG_GUARD_S
import warm_launch

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5")
needs_transformers_5 = pytest.mark.skipif(
    not TRANSFORMERS_5,
    reason="the example's --fsdp needs transformers >= 5 (4.x has no FSDP version in fsdp_config); refused there",
)

DRIVER = os.path.join(ROOT, "tests", "fsdp_trainer_run.py")
FSDP_CPU_CONFIG = os.path.join(ROOT, "examples", "accelerate_fsdp_cpu.yaml")
GRAD_REL_TOL = 1e-4
TIMEOUT_S = HANG_GUARD_S


def _env() -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")


def _check(proc: subprocess.CompletedProcess | subprocess.Popen, cmd: list[str], log: str) -> None:
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-6000:]}"


def _torchrun(nproc: int, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(port), *extra]


def _accelerate_fsdp(nproc: int) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP_CPU_CONFIG,
            "--num_processes", str(nproc), "--main_process_port", str(free_port())]


def _run(cmd: list[str]) -> str:
    proc = warm_launch.run(cmd, _env(), ROOT, TIMEOUT_S)
    log = proc.stdout + proc.stderr
    _check(proc, cmd, log)
    return log


def _run_two_nodes(script: list[str]) -> list[str]:
    """Both node commands of a 2 x 2 torchrun world on the loopback interface, at once."""
    port = free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port), *script]
            for node in (0, 1)]
    launches = [warm_launch.Launch(c, _env(), ROOT) for c in cmds]
    procs = []
    try:
        procs = [launch.wait(TIMEOUT_S) for launch in launches]
    finally:
        if len(procs) < len(launches):  # one timed out: the other node may wait for it forever
            for launch in launches:
                launch.kill()
    logs = []
    for cmd, proc in zip(cmds, procs):
        log = proc.stdout + proc.stderr
        _check(proc, cmd, log)
        logs.append(log)
    return logs


def _state(out_dir: str) -> dict:
    import json

    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch each configuration once (on demand): its trainer_state.json, record, logs."""
    cache: dict[str, dict] = {}

    def driver(name: str, *args: str) -> tuple[list[str], str, str]:
        out = str(tmp_path_factory.mktemp(name))
        dump = os.path.join(out, "record.pt")
        return [DRIVER, "--dump", dump, "--output_dir", out, *COMMON, *args], out, dump

    def launch(name: str) -> dict:
        logs: list[str]
        if name == "ref":
            script, out, dump = driver(name, "--per_device_train_batch_size", "2")
            logs = [_run([sys.executable, *script])]
        elif name == "ddp_cp2":
            script, out, dump = driver(name, "--cp_size", "2", "--per_device_train_batch_size", "2", "--max_steps", "1",
                                       "--eval_steps", "0", "--num_eval_examples", "0")
            logs = [_run(_torchrun(2, free_port(), *script))]
        elif name == "fsdp_cp2":
            script, out, dump = driver(name, "--cp_size", "2", "--per_device_train_batch_size", "2",
                                       "--save_steps", "4")
            logs = [_run(_accelerate_fsdp(2) + script)]
        elif name == "hsdp":
            script, out, dump = driver(name, "--cp_size", "2", "--per_device_train_batch_size", "1",
                                       "--fsdp", "hybrid_shard")
            logs = [_run(_accelerate_fsdp(4) + script)]
        elif name == "multinode":
            script, out, dump = driver(name, "--cp_size", "2", "--per_device_train_batch_size", "1",
                                       "--fsdp", "full_shard")
            logs = _run_two_nodes(script)
        else:
            raise KeyError(name)
        return {"state": _state(out), "record": torch.load(dump, weights_only=False), "logs": logs, "out": out}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = launch(name)
        return cache[name]

    return get


def _assert_same_run(got: dict, ref: dict, name: str) -> None:
    _assert_same(_losses(got["state"]), _losses(ref["state"]), f"{name} training loss")
    _assert_same(_grad_norms(got["state"]), _grad_norms(ref["state"]), f"{name} gradient norm")
    _assert_same(_eval_losses(got["state"]), _eval_losses(ref["state"]), f"{name} eval loss")


def _assert_same_initial_weights(got: dict, ref: dict, name: str) -> None:
    init, init_ref = got["record"]["initial"], ref["record"]["initial"]
    assert sorted(init) == sorted(init_ref)
    different = [n for n in init_ref if not torch.equal(init[n], init_ref[n])]
    assert not different, f"{name}: initial weights differ from one process's: {different}"


@needs_transformers_5
@pytest.mark.parametrize("name, mesh", [
    ("fsdp_cp2", ((2,), ["S(0)"])),
    ("hsdp", ((2, 2), ["R", "S(0)"])),
    ("multinode", ((4,), ["S(0)"])),
])
def test_fsdp2_trains_what_one_process_trains(runs, name, mesh):
    ref, got = runs("ref"), runs(name)
    record = got["record"]
    # The real FSDP2 path ran (not DDP): the model is an FSDP2 module whose every parameter
    # is a DTensor on the expected mesh.
    assert record["is_fsdp2"] and record["model_class"].startswith("FSDP"), record["model_class"]
    assert sorted(record["meshes"]) == sorted(record["first_grad"])
    assert {(shape, tuple(pl)) for shape, pl in record["meshes"].values()} == {(mesh[0], tuple(mesh[1]))}
    # The chunked loss ran under FSDP2 (on by default under CP): no forward returned full
    # logits, while the one-process reference's did.
    assert record["logits_widths"] == {0}, record["logits_widths"]
    assert ref["record"]["logits_widths"] == {record["initial"]["lm_head.weight"].shape[0]}
    assert all("[hf_ring] chunked loss on (weights sharded by: fsdp2)" in log for log in got["logs"])
    _assert_same_run(got, ref, name)
    _assert_same_initial_weights(got, ref, name)
    error = grads_rel_err(record["first_grad"], ref["record"]["first_grad"])
    assert error <= GRAD_REL_TOL, f"{name}: first gradient off by {error:.2e} (relative norm)"
    assert got["state"]["global_step"] == STEPS


@needs_transformers_5
def test_ddp_starts_from_the_same_weights(runs):
    """The same --seed builds the same model under DDP as under FSDP2 and in one process."""
    got = runs("ddp_cp2")
    assert "[hf_ring] gradients: ddp over 2 processes (loss share x2)" in got["logs"][0], got["logs"][0][-3000:]
    assert not got["record"]["is_fsdp2"]
    _assert_same_initial_weights(got, runs("ref"), "ddp_cp2")


@needs_transformers_5
def test_multinode_keeps_each_cp_group_inside_a_node(runs):
    logs = runs("multinode")["logs"]
    for node, log in enumerate(logs):
        for local in range(2):
            rank = 2 * node + local
            line = f"[hf_ring] rank {rank}/4 (dist_backend gloo): dp_rank {node}/2, cp_rank {local}/2"
            assert line in log, (node, log[-3000:])


@needs_transformers_5
def test_resume_from_sharded_checkpoint(runs, tmp_path):
    """torchrun, --fsdp full_shard, resumed from the accelerate-launched run's step-4 checkpoint
    (sharded model and optimizer): steps 5-8 log what the uninterrupted run logged."""
    full = runs("fsdp_cp2")
    checkpoint = os.path.join(full["out"], "checkpoint-4")
    assert os.path.isdir(os.path.join(checkpoint, "pytorch_model_fsdp_0")), os.listdir(checkpoint)
    out = str(tmp_path / "resumed")
    log = _run(_torchrun(2, free_port(), EXAMPLE, "--output_dir", out, *COMMON, "--cp_size", "2",
                         "--per_device_train_batch_size", "2", "--fsdp", "full_shard",
                         "--resume_from_checkpoint", checkpoint))
    assert "[hf_ring] gradients: fsdp2 mesh (2,) over 2 processes" in log, log[-3000:]
    resumed = _state(out)
    later = {s for s in range(5, STEPS + 1)}
    for read, what in ((_losses, "loss"), (_grad_norms, "gradient norm")):
        got = {s: v for s, v in read(resumed).items() if s in later}
        _assert_same(got, {s: v for s, v in read(full["state"]).items() if s in later}, f"resumed {what}")
    _assert_same({STEPS: _eval_losses(resumed)[STEPS]}, {STEPS: _eval_losses(full["state"])[STEPS]}, "resumed eval")


@needs_transformers_5
def test_sharded_checkpoint_consolidates_for_one_process(runs, tmp_path):
    """The cp 2 FSDP2 checkpoint (torch.distributed.checkpoint shards), merged with
    accelerate's merge_fsdp_weights, loads into a plain model in this one process and gives
    the eval loss that the sharded run logged at that step."""
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import finetune_llama_long
    from long_context_data import ByteTokenizer, passkey_dataset

    from hf_ring import RingDataCollator
    from hf_ring.training.loss import count_valid_tokens, token_loss_sum

    full = runs("fsdp_cp2")
    merged = str(tmp_path / "merged")
    merge_fsdp_weights(os.path.join(full["out"], "checkpoint-4", "pytorch_model_fsdp_0"), merged)
    args = finetune_llama_long.parse_args(COMMON)
    tokenizer = ByteTokenizer()
    model = finetune_llama_long.build_model(args, tokenizer, "sdpa")
    model.load_state_dict(load_file(os.path.join(merged, "model.safetensors")), strict=True)
    model.eval()
    collate = RingDataCollator(tokenizer.pad_token_id, cp_size=1)
    means = []  # the stock Trainer's eval_loss: the mean over examples of their batch's token mean
    with torch.no_grad():
        for row in passkey_dataset(tokenizer, args.num_eval_examples, args.seq_len, seed=args.seed + 1):
            batch = collate([row])  # per_device_eval_batch_size 1, as the run
            shift_labels = batch.pop("shift_labels")
            batch.pop("labels")
            means.append(float(token_loss_sum(model(**batch).logits, shift_labels).double())
                         / int(count_valid_tokens(shift_labels)))
    expected = sum(means) / len(means)
    logged = _eval_losses(full["state"])[4]
    assert abs(expected - logged) <= 1e-4 * abs(logged), (expected, logged)


def test_weight_sharding_checks_in_a_real_world():
    """One spawned gloo world of 2 (see tests/fsdp_world_checks.py)."""
    from fsdp_world_checks import world_checks

    for seen in run_world(2, world_checks):
        assert seen["ddp"] == ("DistributedDataParallel", "ddp", 2)
        # accelerate 1.15 on CPU, unpatched: FSDP asked for, DDP delivered, refused by name.
        assert seen["unpatched_class"] == "DistributedDataParallel"
        assert "FSDP was requested" in seen["unpatched_error"] and "enable_fsdp_on_cpu" in seen["unpatched_error"]
        assert seen["patched_is_fsdp2"] and seen["patched_all_dtensor"]
        assert seen["patched"] == ("fsdp2", 2, (2,))
        assert seen["dp_only_mesh_error"].startswith("ValueError") and "hybrid_shard" in seen["dp_only_mesh_error"]
        assert seen["ddp_subgroup_error"].startswith("ValueError") and "DDP reduces" in seen["ddp_subgroup_error"]
        assert "not wrapped in DDP or FSDP2" in seen["bare_error"]
        assert seen["fsdp1_error"].startswith("NotImplementedError") and "FSDP2" in seen["fsdp1_error"]
        # What the refusal prevents: one cp-2 step's gradient, reduced over the world's mesh,
        # is exact (float32 sums in another order; measured 6e-8); over the dp-only mesh each
        # CP rank keeps the gradient of its own shard only (measured 0.64 and 0.76).
        assert seen["world_mesh_gradient_error"] <= GRAD_REL_TOL, seen["world_mesh_gradient_error"]
        assert seen["dp_only_mesh_gradient_error"] > 0.1, seen["dp_only_mesh_gradient_error"]
        # The chunked loss under FSDP2, tied and untied, head in Accelerate's tail unit or in the
        # root's: the gradient exact (float32 sums in another order), the logits never full.
        chunked = seen["chunked"]
        for key in ((False, "accelerate"), (False, "root"), (True, "accelerate"), (True, "root")):
            error, width = chunked[key]
            assert error <= GRAD_REL_TOL and width == 0, (key, error, width)
        assert "reshards its weight after its forward" in chunked["resharding_error"], chunked["resharding_error"]


# ---- in-process checks (no launch) ----


def test_accelerate_own_cp_and_sp_are_refused():
    from types import SimpleNamespace

    from hf_ring.training.weight_sharding import check_accelerate_parallelism

    for name in ("cp_size", "sp_size"):
        config = SimpleNamespace(cp_size=1, sp_size=1)
        setattr(config, name, 2)
        with pytest.raises(ValueError, match=name):
            check_accelerate_parallelism(SimpleNamespace(parallelism_config=config))
    check_accelerate_parallelism(SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=1, sp_size=1)))
    check_accelerate_parallelism(SimpleNamespace(parallelism_config=None))


@needs_transformers_5
def test_fsdp_training_arguments():
    from hf_ring.training.weight_sharding import fsdp_training_arguments

    assert fsdp_training_arguments(None, 2, 4) == {}
    full = fsdp_training_arguments("full_shard", 2, 4)
    assert full["fsdp"] is True and full["fsdp_config"]["version"] == 2 and "parallelism_config" not in full
    hybrid = fsdp_training_arguments("hybrid_shard", 2, 4)["parallelism_config"]
    assert (hybrid.dp_replicate_size, hybrid.dp_shard_size, hybrid.cp_size) == (2, 2, 1)
    with pytest.raises(ValueError, match="hybrid_shard"):
        fsdp_training_arguments("hybrid_shard", 2, 2)  # dp_size 1: nothing to replicate over
    with pytest.raises(ValueError, match="divides"):
        fsdp_training_arguments("full_shard", 2, 3)
    with pytest.raises(ValueError, match="mode"):
        fsdp_training_arguments("shard_grad_op", 2, 4)


def test_cpu_fsdp_patch_refuses_accelerate_older_than_it_was_read_in():
    from hf_ring.patches import accelerate as accelerate_patches

    with pytest.raises(accelerate_patches.UnsupportedAccelerateVersion, match="1.15.0"):
        accelerate_patches._check_cpu_fsdp_version("1.14.0")
    # Newer 1.x: accepted behind enable_fsdp_on_cpu's shape check (and the table's one warning).
    for version in ("1.15.0", "1.16.0"):
        accelerate_patches._check_cpu_fsdp_version(version)
