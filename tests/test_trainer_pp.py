"""RingTrainer with pipeline parallelism logs what one process logs.

Runs examples/finetune_llama_long.py for real (``accelerate launch``, gloo on CPU, float32, a
fixed seed) at pp 2 x cp 2 on 4 processes, and compares the Trainer's own logs
(trainer_state.json) with the same example at cp 1 on one process: the training loss and the
gradient norm of every step and the eval loss (forward only through the stages), within 1e-4
relative (REL_TOL, the Trainer suite's). Every run sees the same 4 examples a step (2 a
micro-step x gradient accumulation 2; at pp 2 each micro-step is PyTorch's schedule over 2
micro-batches). A 4-layer Llama: 2 stages of 2 layers (1F1B), or 4 stages of one, two a rank
(Interleaved1F1B, InterleavedZeroBubble). Measured on 2026-12-07: worst 3.8e-7 relative over
loss, grad_norm and eval_loss (float32 sums in another order).

The final model the pp 2 x cp 2 run saves (its stages gathered) loads in one process, holds
every weight of the model, and evaluates there to the eval_loss the run logged through its
stages (1e-4, float32 forwards in another order).

In-process: what is not composed with the stages is refused by name (the trainer's
construction, the model's cut, the example's flags).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from test_trainer_cp import REL_TOL, _assert_same_logs, _eval_losses, _launch, _losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
PP = ["--num_layers", "4", "--max_steps", str(STEPS), "--eval_steps", "2", "--num_eval_examples", "4",
      "--per_device_train_batch_size", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each configuration launched once, on demand: its trainer_state.json and output folder."""
    cache: dict[str, dict] = {}
    pp = ["--pp_size", "2", "--cp_size", "2", "--pp_microbatches", "2"]
    configs = {
        "cp1": (1, PP), "packed_cp1": (1, [*PP, "--packing"]),
        "pp2_cp2": (4, [*PP, *pp, "--pp_schedule", "1F1B"]),
        "pp2_cp2_interleaved": (4, [*PP, *pp, "--pp_schedule", "Interleaved1F1B", "--no_save_model"]),
        "packed_pp2_cp2_zero_bubble": (4, [*PP, *pp, "--pp_schedule", "InterleavedZeroBubble", "--packing",
                                           "--no_save_model"]),
    }
    expect = {"pp2_cp2": ("pp_rank 1/2", "pipeline: 1F1B, 2 stages (this rank: [1], layers [(2, 4)])"),
              "pp2_cp2_interleaved": ("pipeline: Interleaved1F1B, 4 stages (this rank: [1, 3]",),
              "packed_pp2_cp2_zero_bubble": ("pipeline: InterleavedZeroBubble, 4 stages (this rank: [0, 2]",)}

    def get(name: str) -> dict:
        if name not in cache:
            nproc, args = configs[name]
            out = str(tmp_path_factory.mktemp(name))
            cache[name] = _launch(nproc, out, args, expect.get(name, ()))
            cache[name]["_output_dir"] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name,ref", [("pp2_cp2", "cp1"), ("pp2_cp2_interleaved", "cp1"),
                                      ("packed_pp2_cp2_zero_bubble", "packed_cp1")])
def test_pp2_cp2_logs_what_one_process_logs(runs, name, ref):
    got, want = runs(name), runs(ref)
    assert sorted(_losses(want)) == list(range(1, STEPS + 1)) and _eval_losses(want), want["log_history"]
    _assert_same_logs(got, want, name)
    pairs = [(g[k], w[k]) for g, w in zip(got["log_history"], want["log_history"])
             for k in ("loss", "grad_norm", "eval_loss") if k in w]
    print(f"{name} against {ref}: worst of {len(pairs)} logged figures {max(abs(a - b) / abs(b) for a, b in pairs):.1e}")


def test_the_saved_model_is_whole_and_loads_in_one_process(runs):
    """The 1F1B run's final model (its stages gathered) loads in one process with every weight
    the one-process run's model has, and evaluates there, on the example's eval set (SDPA, each
    example alone), to the eval_loss the run logged at its last step through the stages."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from long_context_data import ByteTokenizer, passkey_dataset

    from hf_ring.training.loss import token_loss_sum

    run = runs("pp2_cp2")
    got = AutoModelForCausalLM.from_pretrained(run["_output_dir"], attn_implementation="sdpa").eval()
    want = AutoModelForCausalLM.from_pretrained(runs("cp1")["_output_dir"]).state_dict()
    assert sorted(got.state_dict()) == sorted(want) and any("layers.3." in name for name in want)
    losses = []
    with torch.no_grad():
        for example in passkey_dataset(ByteTokenizer(), 4, 256, seed=4):  # --seed 3: the eval set's seed is 4
            ids, labels = torch.tensor([example["input_ids"]]), torch.tensor([example["labels"]])
            shift = torch.full_like(labels, -100)
            shift[:, :-1] = labels[:, 1:]
            losses.append((token_loss_sum(got(input_ids=ids).logits, shift) / shift.ne(-100).sum()).item())
    logged = _eval_losses(run)[STEPS]
    print(f"the saved pp2 x cp2 model's eval loss in one process: {sum(losses) / len(losses)} (logged {logged})")
    assert abs(sum(losses) / len(losses) - logged) <= REL_TOL * abs(logged)


# ---- refusals, in process ----


def _trainer(**changes):
    """A stand-in for a Ring trainer under pp 2 x cp 2 with nothing refused (``changes`` plant one)."""
    from hf_ring import ContextParallelState
    from hf_ring.distributed.groups import BUILT_AXES, AxisGroup, ProcessMesh
    from hf_ring.distributed.mesh import ParallelDims

    dims = ParallelDims(changes.pop("world", 4), cp=2, pp=2, tp=changes.pop("tp", 1))
    mesh = ProcessMesh(dims, {a: AxisGroup(None, dims.coord(a, 0), dims.size(a), dims.group_ranks(a, 0))
                              for a in BUILT_AXES})
    args = SimpleNamespace(fsdp="", gradient_checkpointing=False, torch_compile=False, save_strategy="no")
    trainer = SimpleNamespace(ring_state=ContextParallelState(mesh), args=args, model=torch.nn.Linear(2, 2),
                              accelerator=SimpleNamespace(scaler=None, state=SimpleNamespace()),
                              chunked_loss=SimpleNamespace(enabled=None), eval_dataset=None,
                              ring_plugin=SimpleNamespace(pp_schedule="1F1B"), data_collator=None)
    for key, value in changes.items():
        target = args if hasattr(args, key) else trainer
        setattr(target, key, value)
    return trainer


@pytest.mark.parametrize("change,subclass_loss,match", [
    ({}, True, r"a loss of the trainer's own \(the TRL trainers"),
    ({"tp": 2, "world": 8}, False, r"tensor parallelism inside a stage \(tp_size=2\)"),
    ({"fsdp": "full_shard"}, False, "FSDP2 or DeepSpeed inside a stage"),
    ({"is_deepspeed_enabled": True}, False, "FSDP2 or DeepSpeed inside a stage"),
    ({"gradient_checkpointing": True}, False, "gradient checkpointing inside a stage"),
    ({"torch_compile": True}, False, "torch.compile of the stages"),
    ({"chunked_loss": SimpleNamespace(enabled=True)}, False, "the chunked loss on the last stage"),
    ({"save_strategy": "steps"}, False, r"checkpoints during training.*trainer.save_model\(\)"),
    ({"eval_dataset": [1], "ring_plugin": SimpleNamespace(pp_schedule="ZBVZeroBubble")}, False,
     "evaluation under ZBVZeroBubble"),
])
def test_what_the_stages_do_not_compose_is_refused_by_name(change, subclass_loss, match):
    from hf_ring.training.pp.checks import check_pipeline_trainer

    check_pipeline_trainer(_trainer(), subclass_loss=False)  # the stand-in itself passes
    with pytest.raises(NotImplementedError, match=r"with pipeline parallelism \(pp_size=2\): " + match):
        check_pipeline_trainer(_trainer(**change), subclass_loss=subclass_loss)


def test_collators_the_stages_cannot_take_are_refused():
    from hf_ring.training.collator import RingDataCollator
    from hf_ring.training.pp.checks import check_pipeline_trainer
    from hf_ring.training.pp.collator import PipelineDataCollator

    check_pipeline_trainer(_trainer(data_collator=PipelineDataCollator(0, packing=True, micro_batches=2)), False)
    with pytest.raises(NotImplementedError, match="packed rows from a RingDataCollator"):
        check_pipeline_trainer(_trainer(data_collator=RingDataCollator(0, packing=True)), False)
    with pytest.raises(NotImplementedError, match="an attention_mask"):
        check_pipeline_trainer(_trainer(data_collator=RingDataCollator(0, return_attention_mask=True)), False)


class _CausalLM(torch.nn.Module):
    """A causal LM's outline, as hf_ring.pipeline.refusals reads it (``config`` given)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
        self.model.norm, self.model.embed = torch.nn.LayerNorm(2), torch.nn.Embedding(4, 2)
        self.model.get_input_embeddings = lambda: self.model.embed
        self.lm_head = torch.nn.Linear(2, 4, bias=False)

    @property
    def base_model(self):
        return self.model


def test_models_the_stages_cannot_cut_are_refused_by_name():
    from hf_ring.pipeline.refusals import check_pipeline_model

    check_pipeline_model(_CausalLM(SimpleNamespace()))
    with pytest.raises(NotImplementedError, match="an image-text model"):
        check_pipeline_model(_CausalLM(SimpleNamespace(vision_config=object())))
    with pytest.raises(NotImplementedError, match=r"expert parallelism \(DistributedConfig\(ep_size=2\)\)"):
        check_pipeline_model(_CausalLM(SimpleNamespace(distributed_config=SimpleNamespace(ep_size=2))))


def test_the_example_refuses_what_the_stages_do_not_compose():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import finetune_llama_long

    base = ["--pp_size", "2", "--cp_size", "2", "--per_device_train_batch_size", "2"]
    args = finetune_llama_long.parse_args(base)
    assert (args.pp_microbatches, args.pp_schedule) == (2, "1F1B")
    for extra in (["--tp_size", "2"], ["--fsdp", "full_shard"], ["--lora_r", "4"], ["--offload_checkpoints"],
                  ["--save_steps", "2"], ["--cp_pattern", "ulysses"], ["--pp_microbatches", "3"]):
        with pytest.raises(SystemExit):
            finetune_llama_long.parse_args([*base, *extra])
