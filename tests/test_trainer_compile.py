"""``RingTrainer`` with ``TrainingArguments(torch_compile=True)`` at cp 2 logs what the
uncompiled run logs, on a gloo world of 2 (spawned; Accelerate compiles the DDP-wrapped
model). Two training steps of a tiny 1-layer Llama on dense rows, compiled with
``torch_compile_backend="aot_eager"`` (the custom op and the graph around it as inductor
gets them, without its code generation, which tests/test_compile_cp.py checks and which
costs ~10 s a compile on 2 cores): loss and grad_norm of every step within 1e-4 of the
eager run's. The compiled run must have run the ring's op once per layer and forward
(``OP_CALLS``): a Trainer that did not compile, or fell back to eager, fails.
"""

from __future__ import annotations

import os

import torch

from distributed import free_port, run_world

TOL = 1e-4
STEPS = 2


def _run_trainer(tmp: str, compiled: bool) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import hf_ring
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("ring_flash")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(3, 64, (24,), generator=g).tolist()} for _ in range(8)]
    extra = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
    args = TrainingArguments(output_dir=os.path.join(tmp, str(compiled)), report_to=[], use_cpu=True,
                             max_steps=STEPS, logging_steps=1, per_device_train_batch_size=2, learning_rate=1e-3,
                             lr_scheduler_type="constant", seed=3, data_seed=3, save_strategy="no",
                             disable_tqdm=True, ddp_find_unused_parameters=False, **extra)
    plugin = hf_ring.RingAttentionPlugin(cp_size=2)
    trainer = hf_ring.RingTrainer(model=model, args=args, ring_plugin=plugin, train_dataset=data,
                                  data_collator=plugin.make_collator(pad_token_id=0))
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e]


def _rank_main(rank: int, world: int, tmp: str, port: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hf_ring.hf.compiled import OP_CALLS
    torch._dynamo.reset()
    eager = _run_trainer(tmp, compiled=False)
    before = sum(OP_CALLS.values())
    compiled = _run_trainer(tmp, compiled=True)
    return {"eager": eager, "compiled": compiled, "op_calls": sum(OP_CALLS.values()) - before}


def test_torch_compile_true_logs_what_the_eager_run_logs(tmp_path):
    ranks = run_world(2, _rank_main, str(tmp_path), free_port())
    for r in ranks:
        assert r["op_calls"] == STEPS, r["op_calls"]  # 1 layer, one forward per step, compiled
        assert len(r["compiled"]) == len(r["eager"]) == STEPS
        for got, ref in zip(r["compiled"], r["eager"]):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - ref[key]) <= TOL * abs(ref[key]), (key, got, ref)
