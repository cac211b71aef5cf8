"""Accelerate's ``ParallelismConfig`` as the entry point to hf_ring's CP (hf_ring/training/parallelism_config.py).

Without a world: where the config is read from (TrainingArguments, accelerate launch's
environment), what is refused, and that the view Accelerate gets has the CP axis folded into
``dp_shard`` with every rank where it was: compared rank by rank with hf_ring's mesh, whose
``fsdp`` axis (``dp_shard x cp``) is what Accelerate then shards over. In a 2-process world:
a ``RingTrainer`` given ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))``
and no plugin builds hf_ring's CP over both ranks, and hands Accelerate no CP axis (so
torch's cannot engage). That it trains
exactly is tests/test_trainer_cp.py's ``launch_cp2`` (accelerate launch's flags, 8 steps
against one process).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("accelerate.parallelism_config")
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402

from distributed import free_port, run_world  # noqa: E402
from hf_ring.distributed.mesh import ParallelDims  # noqa: E402
from hf_ring.training import parallelism_config as pc  # noqa: E402


@pytest.fixture
def no_launch_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("PARALLELISM_CONFIG_") or key == "ACCELERATE_USE_PARALLELISM_CONFIG":
            monkeypatch.delenv(key)
    return monkeypatch


def test_the_config_is_read_from_training_arguments_then_from_accelerate_launch(no_launch_env):
    from types import SimpleNamespace

    given = ParallelismConfig(cp_size=2)
    assert pc.requested_parallelism_config(SimpleNamespace(parallelism_config=given)) is given
    assert pc.requested_parallelism_config(SimpleNamespace(parallelism_config=None)) is None
    assert pc.requested_parallelism_config(None) is None
    # What accelerate launch --use_parallelism_config --parallelism_config_cp_size 4 --..._tp_size 2 exports.
    no_launch_env.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    no_launch_env.setenv("PARALLELISM_CONFIG_CP_SIZE", "4")
    no_launch_env.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    launched = pc.requested_parallelism_config(None)
    assert pc.plugin_sizes(launched) == (4, 2)
    no_launch_env.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "1")  # Accelerate reads "true" only
    assert pc.requested_parallelism_config(None) is None


def test_what_hf_ring_does_not_take_over_is_refused(no_launch_env):
    with pytest.raises(ValueError, match="sp_size=2"):
        pc.plugin_sizes(ParallelismConfig(sp_size=2))
    from accelerate.utils import TorchContextParallelConfig

    torch_only = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy="alltoall"))
    with pytest.raises(ValueError, match="cp_comm_strategy='alltoall'.*RingAttentionPlugin"):
        pc.plugin_sizes(torch_only)
    with pytest.raises(ValueError, match="parallelism_config says cp_size=2, tp_size=1 but ring_plugin says cp_size=4"):
        pc.check_plugin_agrees(ParallelismConfig(cp_size=2), 4, 1)
    pc.check_plugin_agrees(ParallelismConfig(cp_size=2), 2, 1)
    # hf_ring's own HSDP config (fsdp_training_arguments) lays out data axes only: it sizes nothing.
    assert not pc.asks_for_sizes(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    assert pc.asks_for_sizes(ParallelismConfig(tp_size=2)) and not pc.asks_for_sizes(None)


@pytest.mark.parametrize("sizes", [dict(cp_size=2, dp_shard_size=2), dict(cp_size=2, tp_size=2, dp_shard_size=2),
                                   dict(cp_size=2, dp_replicate_size=2, dp_shard_size=2),
                                   dict(cp_size=4, tp_size=2)])
def test_accelerate_sees_cp_folded_into_dp_shard_with_every_rank_in_place(no_launch_env, sizes):
    config = ParallelismConfig(**sizes)
    view = pc.accelerate_view(config, fsdp=True)
    assert view.cp_size == 1 and view.cp_handler is None
    assert config.cp_size == sizes["cp_size"]  # the user's config is not changed
    world = config.total_size
    assert view.total_size == world
    dims = ParallelDims(world, cp=config.cp_size, tp=config.tp_size, dp_replicate=config.dp_replicate_size,
                        dp_shard=config.dp_shard_size)
    names, shape = view._get_mesh()
    for rank in range(world):
        # Accelerate's coordinates of `rank` on the view's mesh, row-major in its order.
        coords, rest = {}, rank
        for name, n in reversed(list(zip(names, shape))):
            rest, coords[name] = divmod(rest, n)
        assert coords.get("dp_shard", 0) == dims.coord("fsdp", rank), (rank, coords)
        assert coords.get("tp", 0) == dims.coord("tp", rank)
        assert coords.get("dp_replicate", 0) == dims.coord("dp_replicate", rank)


def test_sizes_must_fill_the_world_and_a_model_sharded_at_load_gets_its_replicas_folded(no_launch_env):
    """A config whose axes do not fill the world is refused (folded into no config it would
    run other data-parallel sizes than it says); for a model transformers sharded at load,
    the Trainer sets dp_shard to the model's data-parallel size, replicas included, so the
    view folds the replicas into dp_shard too."""
    pc.check_fills_world(ParallelismConfig(cp_size=2, dp_shard_size=2), 4)
    with pytest.raises(ValueError, match=r"dp_replicate 1 x dp_shard 3 x cp 2 x tp 1 = 6 processes but the world has 4"):
        pc.check_fills_world(ParallelismConfig(cp_size=2, dp_shard_size=3), 4)
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    view = pc.accelerate_view(hsdp, fsdp=True, sharded_at_load=True)
    assert (view.dp_replicate_size, view.dp_shard_size, view.tp_size, view.total_size) == (1, 8, 2, 16)
    assert pc.accelerate_view(hsdp, fsdp=True).dp_replicate_size == 2


def test_without_fsdp_tp_or_replicas_accelerate_gets_no_config(no_launch_env):
    assert pc.accelerate_view(ParallelismConfig(cp_size=2), fsdp=False) is None  # DDP over the world
    assert pc.accelerate_view(ParallelismConfig(cp_size=2), fsdp=True).dp_shard_size == 2
    assert pc.accelerate_view(ParallelismConfig(cp_size=2, tp_size=2), fsdp=False).tp_size == 2
    assert pc.accelerate_view(None, fsdp=True) is None
    plain = ParallelismConfig(dp_shard_size=2)
    assert pc.accelerate_view(plain, fsdp=True) is plain


def test_given_to_accelerate_restores_the_arguments_and_the_launch_flag(no_launch_env):
    from types import SimpleNamespace

    no_launch_env.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    args = SimpleNamespace(parallelism_config="theirs")
    with pc.given_to_accelerate(args, "view"):
        assert args.parallelism_config == "view" and "ACCELERATE_USE_PARALLELISM_CONFIG" not in os.environ
    assert args.parallelism_config == "theirs" and os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"


def _trainer_from_parallelism_config(rank: int, world: int, out_dir: str, port: int) -> dict:
    """A RingTrainer given only TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import hf_ring
    from hf_ring.training.collator import RingDataCollator

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "ring_flash"
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, report_to="none", max_steps=1,
                             parallelism_config=ParallelismConfig(cp_size=2))
    mismatched = "accepted"
    try:
        hf_ring.RingTrainer(model=model, args=args, ring_plugin=hf_ring.RingAttentionPlugin(cp_size=1),
                            data_collator=RingDataCollator(0))
    except ValueError as e:
        mismatched = str(e)
    hf_ring.set_context_parallel_state(None)
    trainer = hf_ring.RingTrainer(model=model, args=args, data_collator=lambda rows: rows)
    s = trainer.ring_state
    return {"cp": (s.cp_size, s.cp_rank, s.cp_ranks), "dp_size": s.dp_size,
            "accelerate_config": trainer.accelerator.parallelism_config,
            "args_config_cp": args.parallelism_config.cp_size, "mismatched": mismatched}


def test_a_ring_trainer_takes_its_sizes_from_training_arguments(tmp_path):
    for rank, r in enumerate(run_world(2, _trainer_from_parallelism_config, str(tmp_path), free_port())):
        assert r["cp"] == (2, rank, (0, 1)) and r["dp_size"] == 1, r
        assert r["accelerate_config"] is None, r  # no FSDP, no TP: DDP over both ranks, nothing for torch's CP
        assert r["args_config_cp"] == 2  # the user's arguments keep what they said
        assert "parallelism_config says cp_size=2, tp_size=1 but ring_plugin says cp_size=1" in r["mismatched"], r
