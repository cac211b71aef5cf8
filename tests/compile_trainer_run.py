"""Runs examples/finetune_llama_long.py with ``--torch_compile`` and proves the compiled path ran.

Launched by tests/test_trainer_cp.py (accelerate launch, or plain python for one process)
with the example's own arguments. Dynamo fails the run if a frame would be recompiled past
its limit (``fail_on_recompile_limit_hit``: past it dynamo runs that frame eagerly, which
passes every comparison while compiling nothing). After training each rank prints one line,
``[compile_trainer_run] rank R: {...}`` (JSON): how many times the ring's custom op and the
chunked loss's ran (from compiled graphs: an uncompiled forward does not call them) and how
many graphs dynamo compiled in all, and each optimizer step's wall time (seconds, the first
ones include the compiles). Without ``--torch_compile`` it reports the eager run's times.

    python tests/compile_trainer_run.py --torch_compile --cp_size 2 ...
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import TrainerCallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import finetune_llama_long  # noqa: E402


class Report(TrainerCallback):
    def __init__(self) -> None:
        self.started, self.step_s = 0.0, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_s.append(round(time.perf_counter() - self.started, 4))

    def on_train_end(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters

        from hf_ring.hf.compiled import OP_CALLS as RING_CALLS
        from hf_ring.memory.chunked_loss_compiled import OP_CALLS as LOSS_CALLS

        report = {"ring_op_calls": sum(RING_CALLS.values()), "loss_op_calls": sum(LOSS_CALLS.values()),
                  "graphs": counters["stats"]["unique_graphs"], "steps": state.global_step,
                  "step_s": self.step_s}
        print(f"[compile_trainer_run] rank {os.environ.get('RANK', '0')}: {json.dumps(report)}", flush=True)


def main() -> None:
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    finetune_llama_long.main(sys.argv[1:], callbacks=[Report()])


if __name__ == "__main__":
    main()
