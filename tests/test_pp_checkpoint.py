"""Checkpoints under pipeline parallelism resume every stage exactly (hf_ring.training.pp.checkpoint).

On the shared gloo world of 4 (pp 2 x cp 2, 1F1B, float64, no launch), with FSDP2 inside the
stages (each rank's weights and optimizer state its shard): a step of ``TrainerPipeline`` and
AdamW, a checkpoint (the whole model gathered, each rank's shard of its stage's optimizer
state), a second step; then a fresh model resumed from the checkpoint takes the second step
again. The resumed step's update of every weight equals the uninterrupted one's (1e-10
relative; measured: 0, bitwise); resumed with the weights but a fresh optimizer (Adam's
moments restarted) it is 1.8 off. Without FSDP2 (measured the same way: 0 and 1.8) the
example's Trainer run resumes end to end in tests/test_trainer_pp.py.

In-process: resuming under another layout, or a pipeline checkpoint without pipeline
parallelism, is refused by name.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

TOL = 1e-10


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's stages' weights, whole (under FSDP2 collective over the stage's ranks)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _trainer(plugin):
    """A stand-in for RingTrainer under PP: its model cut into this rank's stages, AdamW, a constant schedule."""
    from test_pipeline_cp import _model
    from test_trainer_pp import _Accelerator

    from hf_ring.memory.chunked_loss import ChunkedLossConfig
    from hf_ring.training.pp.trainer import TrainerPipeline

    model = _model(torch.float64, "ring_flash")
    trainer = SimpleNamespace(ring_state=plugin.state, loss_mean="tokens", model=model, ring_plugin=plugin,
                              accelerator=_Accelerator(), chunked_loss=ChunkedLossConfig(False),
                              args=SimpleNamespace(should_save=torch.distributed.get_rank() == 0))
    trainer.pipeline = TrainerPipeline(trainer)
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    return trainer


def _step(trainer, batches, count) -> None:
    for i, batch in enumerate(batches):
        trainer.pipeline.train_step(dict(batch), count, sync=i == len(batches) - 1)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad()


def _resume_case(rank: int, world: int, folder: str) -> dict:
    """The second step's update of this rank's stages' weights (whole) under FSDP2 inside the
    stages, uninterrupted, resumed, and resumed with a fresh optimizer; from CP rank 0."""
    import hf_ring
    from test_pipeline_cp import ROWS

    from hf_ring.training.loss import count_valid_tokens
    from hf_ring.training.pp import checkpoint

    plugin = hf_ring.RingAttentionPlugin(cp_size=2, pp_size=2, pp_schedule="1F1B", pp_microbatches=2, pp_fsdp=True)
    plugin.setup()
    collate = plugin.make_collator(pad_token_id=0)
    steps = [[collate([{"input_ids": r} for r in ROWS[i:i + 2]]) for i in (0, 2)],
             [collate([{"input_ids": r} for r in ROWS[i:i + 2]]) for i in (1, 2)]]
    counts = [plugin.global_token_count(sum(count_valid_tokens(b["shift_labels"]) for b in s)) for s in steps]
    path = os.path.join(folder, "checkpoint-1")
    run = _trainer(plugin)
    _step(run, steps[0], counts[0])
    run.args.output_dir = path
    run.pipeline.save(run, path)
    checkpoint.save_optimizer_and_scheduler(run, path)
    before = _whole(run.model)
    _step(run, steps[1], counts[1])
    updates = {"uninterrupted": {n: p - before[n] for n, p in _whole(run.model).items()}}
    for how in ("resumed", "fresh optimizer"):
        again = _trainer(plugin)
        checkpoint.load_stage_weights(path, again.pipeline)
        if how == "resumed":
            checkpoint.load_optimizer_and_scheduler(again, path)
        loaded = _whole(again.model)
        assert all(torch.equal(loaded[n], before[n]) for n in before)  # the checkpoint's weights, exactly
        _step(again, steps[1], counts[1])
        updates[how] = {n: p - before[n] for n, p in _whole(again.model).items()}
    return updates if plugin.state.cp_rank == 0 else {}


def test_a_checkpoint_resumes_every_shard_of_every_stage_exactly(tmp_path):
    from closeness import max_rel
    from distributed import run_world

    results = run_world(4, _resume_case, str(tmp_path))
    updates: dict[str, dict] = {}
    for r in results:
        for how, u in r.items():
            updates.setdefault(how, {}).update(u)
    want = updates["uninterrupted"]
    assert any("layers.0." in n for n in want) and any("lm_head" in n for n in want)  # both stages
    got = {how: max(max_rel(u[n], want[n]) for n in want) for how, u in updates.items() if how != "uninterrupted"}
    print("pp_fsdp=True: the resumed step's updates against the uninterrupted's: "
          + ", ".join(f"{how} {v:.1e}" for how, v in got.items()))
    assert got["resumed"] < TOL and got["fresh optimizer"] > 0.1, got


def _pipeline(pp=2, sharded=False, schedule="1F1B"):
    """A stand-in for TrainerPipeline: what the checkpoint's layout reads."""
    sizes = {"pp": pp}
    state = SimpleNamespace(mesh=SimpleNamespace(size=sizes.__getitem__), loss_size=2)
    return SimpleNamespace(state=state, sharded=sharded,
                           runner=SimpleNamespace(schedule_name=schedule, ranges=[(0, 2), (2, 4)]))


def test_another_layout_or_no_pipeline_is_refused_by_name(tmp_path):
    from hf_ring.training.pp import checkpoint

    with pytest.raises(NotImplementedError, match="holds no pipeline.json, so it was not written under pipeline"):
        checkpoint.check_layout(str(tmp_path), _pipeline())
    (tmp_path / "pipeline.json").write_text(json.dumps(checkpoint.layout(_pipeline())))
    checkpoint.check_layout(str(tmp_path), _pipeline())
    with pytest.raises(NotImplementedError, match=r"another layout \(pp_fsdp=False \(now True\)"):
        checkpoint.check_layout(str(tmp_path), _pipeline(sharded=True))
    with pytest.raises(NotImplementedError, match=r"schedule='1F1B' \(now 'GPipe'\)"):
        checkpoint.check_layout(str(tmp_path), _pipeline(schedule="GPipe"))

    class Stock:
        def _load_optimizer_and_scheduler(self, checkpoint):
            raise AssertionError("the stock loader ran")

    class Trainer(checkpoint.PipelineCheckpoints, Stock):
        pipeline = None

    with pytest.raises(NotImplementedError, match=r"without pipeline parallelism: it was written under pipeline "
                                                  r"parallelism \(pp_size=2\)"):
        Trainer()._load_optimizer_and_scheduler(str(tmp_path))
    os.remove(tmp_path / "pipeline.json")
    with pytest.raises(AssertionError, match="the stock loader ran"):  # a checkpoint of no pipeline: the stock's
        Trainer()._load_optimizer_and_scheduler(str(tmp_path))
