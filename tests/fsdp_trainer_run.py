"""Runs examples/finetune_llama_long.py and records what the weight-sharding tests compare.

Launched by tests/test_trainer_fsdp.py (torchrun, accelerate launch, or plain python for one
process) with the example's own arguments after ``--dump PATH``. Rank 0 writes to PATH
(torch.save): the initial weights (full tensors, gathered from FSDP2 shards), the full
gradient of the first optimizer step (after the wrapper's reduction, before the optimizer),
the wrapped model's class, for FSDP2 every parameter's mesh and placements: proof of
which code path ran, and ``logits_widths``: the last dimension of every forward's logits in
training and evaluation (0 only: the chunked loss ran and the full logits never existed).

    python tests/fsdp_trainer_run.py --dump OUT.pt --cp_size 2 --fsdp full_shard ...
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import TrainerCallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import finetune_llama_long  # noqa: E402


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().cpu()


class Recorder(TrainerCallback):
    """Collects the initial weights and the first step's gradient on every rank (the gathers
    are collective), keeps them on rank 0."""

    def __init__(self) -> None:
        self.record: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if "initial" not in self.record and state.global_step == 0:
            self.record["initial"] = {n: _full(p) for n, p in model.named_parameters()}
        widths = self.record.setdefault("logits_widths", set())
        model.register_forward_hook(lambda module, args, out: widths.add(out.logits.shape[-1]))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if "first_grad" in self.record:
            return
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        self.record["first_grad"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        self.record["model_class"] = type(model).__name__
        self.record["is_fsdp2"] = isinstance(model, FSDPModule)
        self.record["meshes"] = {
            n: (tuple(p.device_mesh.mesh.shape), [str(pl) for pl in p.placements])
            for n, p in model.named_parameters() if isinstance(p, DTensor)
        }


def main() -> None:
    argv = sys.argv[1:]
    i = argv.index("--dump")
    path = argv[i + 1]
    del argv[i:i + 2]
    recorder = Recorder()
    finetune_llama_long.main(argv, callbacks=[recorder])
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        torch.save(recorder.record, path)


if __name__ == "__main__":
    main()
