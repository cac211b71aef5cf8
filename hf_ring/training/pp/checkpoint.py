"""A Ring trainer's checkpoints under pipeline parallelism: written by every stage, resumed
by every stage.

What a checkpoint holds, and why so:

- the model: one whole model that ``from_pretrained`` loads in one process, gathered from
  the stages (``TrainerPipeline.save``, what the Trainer's ``save_model`` call runs); at
  resume each rank reads from it only its own stages' weights (under ``pp_fsdp`` each
  distributed as its shard of the stage's dp x cp ranks);
- the optimizer: each rank's optimizer holds the state of its own stages' parameters only,
  so the stock single ``optimizer.pt`` (rank 0's: the first stage's) cannot hold it. One
  file per pipeline rank, ``pp_optimizer/pp{p}.pt``, written by the stage's first dp x cp
  rank: without FSDP every dp x cp rank of a stage holds the same state (the same summed
  gradients, the same step); under ``pp_fsdp`` each rank holds its shard of it, so one file
  per rank, ``pp_optimizer/pp{p}_shard{s}.pt`` (its local shards). Each file records its
  parameters' names in the optimizer's order, checked at load;
- ``pipeline.json``: the layout the files were written for (pp size, dp x cp ranks a stage,
  FSDP inside the stages, schedule, each stage's decoder layers). A resume under another
  layout is refused by name: the files would fit other parameters or other shards;
- the scheduler (the same on every rank), the per-process RNG states and the trainer state:
  the stock Trainer's files, written and read by its own code.

Resuming a checkpoint written under pipeline parallelism at ``pp_size == 1`` (whose stock
loader would find no ``optimizer.pt`` and silently start a fresh optimizer), and one
written without it under ``pp_size > 1``, are refused.

Must not import TRL or ``hf_ring.training.trainer``.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

LAYOUT_FILE = "pipeline.json"
OPTIMIZER_DIR = "pp_optimizer"
SCHEDULER_FILE = "scheduler.pt"  # the stock Trainer's name (transformers.trainer.SCHEDULER_NAME)


def layout(pipeline: Any) -> dict[str, Any]:
    """What a checkpoint's per-stage files depend on: the same on every rank."""
    state, runner = pipeline.state, pipeline.runner
    return {"pp_size": state.mesh.size("pp"), "dp_x_cp": state.loss_size, "pp_fsdp": pipeline.sharded,
            "schedule": runner.schedule_name, "stage_layers": [list(r) for r in runner.ranges]}


def _optimizer_file(checkpoint: str, pipeline: Any) -> str:
    """This rank's optimizer file: its pipeline rank's, and under FSDP2 its shard's."""
    state = pipeline.state
    name = f"pp{state.mesh.rank('pp')}" + (f"_shard{state.mesh.rank('loss')}" if pipeline.sharded else "")
    return os.path.join(checkpoint, OPTIMIZER_DIR, name + ".pt")


def _writes_optimizer(pipeline: Any) -> bool:
    return pipeline.sharded or pipeline.state.mesh.rank("loss") == 0


def _parameter_names(model: torch.nn.Module, optimizer: Any) -> list[str]:
    """The names of ``optimizer``'s parameters in its state dict's order (its groups')."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save_optimizer_and_scheduler(trainer: Any, output_dir: str) -> None:
    """Write this stage's optimizer state (see the module's docstring), the scheduler and the
    layout into the checkpoint ``output_dir``. Call on every rank."""
    pipeline = trainer.pipeline
    if _writes_optimizer(pipeline):
        local = trainer.optimizer.state_dict()
        # A DTensor's pickle would carry its process groups: keep the rank's shard, rebuilt at load.
        local["state"] = {i: {k: v.to_local().cpu() if isinstance(v, DTensor) else v for k, v in s.items()}
                          for i, s in local["state"].items()}
        path = _optimizer_file(output_dir, pipeline)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"parameter_names": _parameter_names(trainer.model, trainer.optimizer), "optimizer": local}, path)
    if trainer.args.should_save:
        with open(os.path.join(output_dir, LAYOUT_FILE), "w") as f:
            json.dump(layout(pipeline), f, indent=1)
        with warnings.catch_warnings():  # the scheduler's "please also save the optimizer" note: it is saved
            warnings.simplefilter("ignore", UserWarning)
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
    dist.barrier()  # the checkpoint is whole before the Trainer's state and rotation follow


def written_layout(checkpoint: str) -> Optional[dict[str, Any]]:
    """The layout a checkpoint was written under pipeline parallelism for, or None (not so)."""
    path = os.path.join(checkpoint, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_layout(checkpoint: str, pipeline: Any) -> None:
    """Refuse to resume ``checkpoint`` under ``pipeline`` unless it was written for its layout."""
    written, now = written_layout(checkpoint), layout(pipeline)
    if written is None:
        raise NotImplementedError(
            f"resuming {checkpoint} under pipeline parallelism (pp_size={now['pp_size']}): it holds no {LAYOUT_FILE}, "
            "so it was not written under pipeline parallelism (its optimizer state would be the whole model's, not a "
            "stage's) or was written with save_only_model=True (no optimizer state): resume a checkpoint written "
            "under this layout, or start from its model (from_pretrained) without resuming")
    if written != now:
        changed = ", ".join(f"{k}={written.get(k)!r} (now {v!r})" for k, v in now.items() if written.get(k) != v)
        raise NotImplementedError(
            f"resuming {checkpoint} under pipeline parallelism: it was written for another layout ({changed}); each "
            "stage's optimizer state fits its own stage's parameters and shards only. Resume with the layout it was "
            "written with, or start from its model (from_pretrained) without resuming")


def _weight_files(checkpoint: str) -> dict[str, str]:
    """Each weight's name in the checkpoint's whole model -> the safetensors file holding it."""
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {n: os.path.join(checkpoint, file) for n, file in json.load(f)["weight_map"].items()}
    single = os.path.join(checkpoint, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"resuming {checkpoint} under pipeline parallelism: it holds no model.safetensors "
                                "(nor its index), which the stages' checkpoints write; give a checkpoint folder "
                                "this trainer wrote")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {n: single for n in f.keys()}


def load_stage_weights(checkpoint: str, pipeline: Any) -> None:
    """This rank's stages' weights read from the checkpoint's whole model (under FSDP2 each
    distributed over the stage's dp x cp ranks as it is sharded now). Call on every rank."""
    from safetensors import safe_open

    check_layout(checkpoint, pipeline)
    own = pipeline.model.state_dict()
    files = _weight_files(checkpoint)
    missing = [n for n in own if n not in files]
    if missing:
        raise RuntimeError(f"resuming {checkpoint}: its model lacks {len(missing)} weights of this rank's stages "
                           f"({', '.join(missing[:3])}, ...): it is not this model's checkpoint")
    loaded: dict[str, torch.Tensor] = {}
    for path in sorted(set(files[n] for n in own)):
        with safe_open(path, framework="pt") as f:
            for name in (n for n in own if files[n] == path):
                loaded[name] = f.get_tensor(name)
    for name, now in own.items():
        whole = loaded[name].to(device=now.device, dtype=now.dtype)
        # Collective over the stage's ranks under FSDP2: each keeps its shard of the whole weight.
        loaded[name] = distribute_tensor(whole, now.device_mesh, now.placements) if isinstance(now, DTensor) else whole
    pipeline.model.load_state_dict(loaded, strict=True)


def load_optimizer_and_scheduler(trainer: Any, checkpoint: str) -> None:
    """This rank's stage's optimizer state and the scheduler from ``checkpoint`` (written by
    :func:`save_optimizer_and_scheduler` for the same layout)."""
    pipeline = trainer.pipeline
    check_layout(checkpoint, pipeline)
    path = _optimizer_file(checkpoint, pipeline)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"resuming {checkpoint} under pipeline parallelism: it holds no optimizer state for "
                                f"this rank ({os.path.relpath(path, checkpoint)}; a checkpoint written with "
                                "save_only_model=True has none): resume from a whole checkpoint")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    names = _parameter_names(trainer.model, trainer.optimizer)
    if saved["parameter_names"] != names:
        raise RuntimeError(f"resuming {checkpoint}: {os.path.relpath(path, checkpoint)} holds the optimizer state of "
                           "other parameters than this rank's stages' (another model or optimizer grouping)")
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    state = saved["optimizer"]
    for i, entry in state["state"].items():
        param = params[int(i)]
        if isinstance(param, DTensor):  # each shard's state back as the DTensor of its parameter's sharding
            state["state"][i] = {k: DTensor.from_local(v.to(param.device), param.device_mesh, param.placements,
                                                       run_check=False, shape=param.shape, stride=param.stride())
                                 if torch.is_tensor(v) and v.shape == param.to_local().shape and v.dim() > 0 else v
                                 for k, v in entry.items()}
    trainer.optimizer.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))


class PipelineCheckpoints:
    """The Trainer's checkpoint steps, in front of a Ring trainer's bases: under pipeline
    parallelism (``self.pipeline`` set) this module's; otherwise the stock ones, except that a
    checkpoint written under pipeline parallelism is refused (the stock loader would find no
    ``optimizer.pt`` and silently train on with a fresh optimizer). The Trainer calls these
    private methods itself: ``hf_ring.patches.transformers.check_checkpoint_methods`` checks
    their names and parameters when the stages are built."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        if getattr(self, "pipeline", None) is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_stage_weights(resume_from_checkpoint, self.pipeline)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if getattr(self, "pipeline", None) is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer_and_scheduler(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return None
        if getattr(self, "pipeline", None) is not None:
            return load_optimizer_and_scheduler(self, checkpoint)
        written = written_layout(checkpoint)
        if written is not None:
            raise NotImplementedError(
                f"resuming {checkpoint} without pipeline parallelism: it was written under pipeline parallelism "
                f"(pp_size={written['pp_size']}), its optimizer state one file per stage; resume it with the layout "
                f"it was written with ({LAYOUT_FILE}), or start from its model (from_pretrained) without resuming")
        return super()._load_optimizer_and_scheduler(checkpoint)


__all__ = ["PipelineCheckpoints", "check_layout", "layout", "load_optimizer_and_scheduler", "load_stage_weights",
           "save_optimizer_and_scheduler", "written_layout"]
