"""RingTrainer with pipeline parallelism logs what one process logs.

Runs examples/finetune_llama_long.py for real (``accelerate launch``, gloo on CPU, float32, a
fixed seed) at pp 2 x cp 2 on 4 processes, and compares the Trainer's own logs
(trainer_state.json) with the same example at cp 1 on one process: the training loss and the
gradient norm of every step and the eval loss (forward only through the stages), within 1e-4
relative (REL_TOL, the Trainer suite's). Every run sees the same 4 examples a step (2 a
micro-step x gradient accumulation 2; at pp 2 each micro-step is PyTorch's schedule over 2
micro-batches). A 4-layer Llama: 2 stages of 2 layers (1F1B), or 4 stages of one, two a rank
(Interleaved1F1B with FSDP2 inside each stage, over its 2 CP ranks: ``--fsdp full_shard``;
InterleavedZeroBubble). Measured on 2026-12-07: worst 3.8e-7 relative over
loss, grad_norm and eval_loss (float32 sums in another order; with FSDP2 3.0e-7). At cp 2 the
runs take the chunked loss's default (on under CP), so the last stage computes the loss by
chunks against cp 1's full logits (the packed zero-bubble run, measured again with it: 3.0e-7).

The final model the 1F1B and the FSDP2 runs save (their stages gathered, each weight whole)
loads in one process, holds every weight of the model, and evaluates there to the eval_loss
the run logged through its stages (1e-4, float32 forwards in another order).

The 1F1B run checkpoints at steps 2 and 4 (one whole model, each stage's optimizer state:
hf_ring.training.pp.checkpoint); resumed from step 2 on 4 processes it logs steps 3-4 and the
step-4 eval_loss as the uninterrupted run (REL_TOL; measured: 0 difference). Planted,
resuming without the optimizer state: step 4's loss 7.3e-3 relative off (step 3's loss and
norm are the same: they come before the first resumed update). The FSDP2 case's resume is
tests/test_pp_checkpoint.py's, on the shared world.

On the shared gloo world of 4 (float64, no launch): the Trainer's step through
``TrainerPipeline`` (two accumulation micro-steps, clipping, an evaluation), without and with
FSDP2, with the chunked loss and gradient checkpointing inside the stages, equals one
process's, and defects planted in it (the gradients averaged or summed over the wrong ranks,
reduced at every micro-step, scaled by the micro-batch count twice) are caught.

In-process: what is not composed with the stages is refused by name (the trainer's
construction, the model's cut, the example's flags).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from test_trainer_cp import REL_TOL, _assert_same, _assert_same_logs, _eval_losses, _grad_norms, _launch, _losses

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
        "pp2_cp2": (4, [*PP, *pp, "--pp_schedule", "1F1B", "--save_steps", "2"]),  # checkpoints at steps 2, 4
        "pp2_cp2_interleaved_fsdp": (4, [*PP, *pp, "--pp_schedule", "Interleaved1F1B", "--fsdp", "full_shard"]),
        "packed_pp2_cp2_zero_bubble": (4, [*PP, *pp, "--pp_schedule", "InterleavedZeroBubble", "--packing",
                                           "--no_save_model"]),
    }
    expect = {"pp2_cp2": ("pp_rank 1/2", "pipeline: 1F1B, 2 stages (this rank: [1], layers [(2, 4)])"),
              "pp2_cp2_interleaved_fsdp": ("pipeline: Interleaved1F1B, 4 stages (this rank: [1, 3]",
                                           "FSDP2 over each stage's 2 dp x cp ranks"),
              # The chunked loss's default (on under CP) on the last stage: compared with cp 1's full logits.
              "packed_pp2_cp2_zero_bubble": ("pipeline: InterleavedZeroBubble, 4 stages (this rank: [0, 2]",
                                             "the loss chunked on the last stage (no logits)")}

    def get(name: str) -> dict:
        if name not in cache:
            nproc, args = configs[name]
            out = str(tmp_path_factory.mktemp(name))
            cache[name] = _launch(nproc, out, args, expect.get(name, ()))
            cache[name]["_output_dir"] = out
        return cache[name]

    return get


@pytest.mark.parametrize("name,ref", [("pp2_cp2", "cp1"), ("pp2_cp2_interleaved_fsdp", "cp1"),
                                      ("packed_pp2_cp2_zero_bubble", "packed_cp1")])
def test_pp2_cp2_logs_what_one_process_logs(runs, name, ref):
    got, want = runs(name), runs(ref)
    assert sorted(_losses(want)) == list(range(1, STEPS + 1)) and _eval_losses(want), want["log_history"]
    _assert_same_logs(got, want, name)
    pairs = [(g[k], w[k]) for g, w in zip(got["log_history"], want["log_history"])
             for k in ("loss", "grad_norm", "eval_loss") if k in w]
    print(f"{name} against {ref}: worst of {len(pairs)} logged figures {max(abs(a - b) / abs(b) for a, b in pairs):.1e}")


@pytest.mark.parametrize("name", ["pp2_cp2", "pp2_cp2_interleaved_fsdp"])
def test_the_saved_model_is_whole_and_loads_in_one_process(runs, name):
    """The final model of the 1F1B run and of the interleaved run with FSDP2 inside the stages
    (its stages gathered, each weight whole) loads in one process with every weight the
    one-process run's model has, and evaluates there, on the example's eval set (SDPA, each
    example alone), to the eval_loss the run logged at its last step through the stages."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from long_context_data import ByteTokenizer, passkey_dataset

    from hf_ring.training.loss import token_loss_sum

    run = runs(name)
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
    print(f"the saved {name} model's eval loss in one process: {sum(losses) / len(losses)} (logged {logged})")
    assert abs(sum(losses) / len(losses) - logged) <= REL_TOL * abs(logged)


def test_resuming_the_step_2_checkpoint_logs_what_the_uninterrupted_run_logs(runs, tmp_path):
    """The 1F1B run's step-2 checkpoint (one whole model, each stage's optimizer state, the
    layout, the scheduler and every process's RNG state) resumed at pp 2 x cp 2 logs steps 3
    and 4 (loss, grad_norm) and the step-4 eval_loss as the uninterrupted run, within
    REL_TOL (measured: 0). Resuming with a fresh optimizer instead (Adam's moments restarted)
    is caught: step 4's loss 7.3e-3 relative off (measured 2026-12-07)."""
    full = runs("pp2_cp2")
    checkpoint = os.path.join(full["_output_dir"], "checkpoint-2")
    written = sorted(os.listdir(checkpoint))
    assert {"pipeline.json", "pp_optimizer", "model.safetensors", "scheduler.pt", "trainer_state.json",
            "rng_state_3.pth"} <= set(written) and "optimizer.pt" not in written, written
    assert sorted(os.listdir(os.path.join(checkpoint, "pp_optimizer"))) == ["pp0.pt", "pp1.pt"]
    resumed = _launch(4, str(tmp_path / "resumed"), [*PP, "--pp_size", "2", "--cp_size", "2", "--pp_microbatches",
                                                     "2", "--pp_schedule", "1F1B", "--no_save_model",
                                                     "--resume_from_checkpoint", checkpoint])
    later = {"loss": _losses, "grad_norm": _grad_norms, "eval_loss": _eval_losses}
    worst = 0.0
    for what, read in later.items():
        want = {s: v for s, v in read(full).items() if s > 2}
        got = {s: v for s, v in read(resumed).items() if s > 2}
        assert want, what
        _assert_same(got, want, f"resumed {what}")
        worst = max([worst, *(abs(got[s] - v) / abs(v) for s, v in want.items())])
    # It resumed (a run from scratch logs the same steps): its train_loss is the mean of the two steps it ran.
    ran = [v for s, v in _losses(full).items() if s > 2]
    train_loss = [e["train_loss"] for e in resumed["log_history"] if "train_loss" in e]
    assert train_loss and abs(train_loss[-1] - sum(ran) / 2) <= REL_TOL * abs(train_loss[-1]), (train_loss, ran)
    print(f"resumed from the step-2 checkpoint: worst relative difference over steps 3-4 {worst:.1e}")


# ---- the Trainer's step on the shared world of 4, and defects planted in it ----


class _Accelerator:
    """What ``TrainerPipeline`` reads of the Accelerator: ``prepare_model`` (to keep the model
    unwrapped) and a ``clip_grad_norm_`` slot it replaces."""

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        return model


def _flat_over_world(parameters, state):
    """Planted: every rank's gradients summed over the whole world, as one flat bucket (padded to
    the longest rank's, so that the stages' different parameter lists cannot hang the sum)."""
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    longest = torch.tensor([flat.numel()])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    padded = torch.cat([flat, flat.new_zeros(int(longest) - flat.numel())])
    dist.all_reduce(padded)
    for g, piece in zip(grads, padded[:flat.numel()].split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def _fsdp_mean(shard_stages):
    """Planted: FSDP2's default reduction inside the stages, the mean over the stage's ranks."""
    def planted(stages, state, *args, **kwargs):
        mesh = shard_stages(stages, state, *args, **kwargs)
        for stage in stages.values():
            for module in stage.modules():
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_gradient_divide_factor(float(state.loss_size))
        return mesh

    return planted


def _counting(module, name: str, counts: list):
    """``module.<name>`` wrapped to count its calls in ``counts[0]``; returns the original."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    return original


def _trainer_step_case(rank: int, world: int, cases: list) -> list:
    """One optimizer step's gradients through ``TrainerPipeline`` at pp 2 x cp 2 (float64):
    two accumulation micro-steps of 2 rows (each the schedule over 2 micro-batches, the
    gradients reduced at the second; the two of different lengths, so the second builds a
    schedule of its own), then the clipping to 0.5 over every stage, then the first batch
    evaluated through the stages. Per case ``(schedule, pp_fsdp, defect, options)`` (defect
    None: none; options: "chunked", the chunked loss in 3-token chunks on the last stage;
    "checkpointing" / "reentrant", gradient checkpointing turned on as the Trainer does, after
    the stages are built), the logged loss, the norm, the clipped gradients (whole, from CP
    rank 0), this CP shard's eval token sum, and the calls to the chunked loss and to the
    attention modules of this rank's layers."""
    import contextlib
    from types import SimpleNamespace

    import hf_ring
    from hf_ring.memory import chunked_loss
    from hf_ring.pipeline import fsdp
    from hf_ring.training.loss import count_valid_tokens
    from hf_ring.training.pp import trainer as pp_trainer
    from test_pipeline_cp import ROWS, _DefaultScaling, _model

    plugins = {(schedule, sharded): hf_ring.RingAttentionPlugin(cp_size=2, pp_size=2, pp_schedule=schedule,
                                                                pp_microbatches=2, pp_fsdp=sharded)
               for schedule, sharded, _, _ in cases}
    for plugin in plugins.values():
        plugin.setup()
    plugin = next(iter(plugins.values()))
    collate = plugin.make_collator(pad_token_id=0)
    batches = [collate([{"input_ids": r} for r in ROWS[i:i + 2]]) for i in (0, 2)]
    count = plugin.global_token_count(sum(count_valid_tokens(b["shift_labels"]) for b in batches))
    original, original_shard, out = pp_trainer.reduce_stage_gradients, fsdp.shard_stages, []
    for schedule, sharded, defect, options in cases:
        plugin = plugins[(schedule, sharded)]
        pp_trainer.reduce_stage_gradients = _flat_over_world if defect == "flat_over_world" else original
        fsdp.shard_stages = _fsdp_mean(original_shard) if defect == "fsdp_mean" else original_shard
        chunk_calls, attn_calls = [0], [0]
        counted = _counting(chunked_loss, "chunked_token_loss_sum", chunk_calls)
        try:
            with _DefaultScaling() if defect == "scale_grads" else contextlib.nullcontext():
                model = _model(torch.float64, "ring_flash")
                # The trainer's own ChunkedLossConfig: False keeps the logits path checked too.
                chunked = chunked_loss.ChunkedLossConfig("chunked" in options, chunk_tokens=3)
                stand_in = SimpleNamespace(ring_state=plugin.state, loss_mean="tokens", model=model,
                                           ring_plugin=plugin, accelerator=_Accelerator(), chunked_loss=chunked)
                pipeline = pp_trainer.TrainerPipeline(stand_in)
                if "checkpointing" in options or "reentrant" in options:  # as Trainer.train: on the pruned model
                    model.activation_checkpointing_enable(
                        activation_checkpointing_kwargs={"use_reentrant": True} if "reentrant" in options else None)
                # This rank's layers' attention in the training steps; a recompute runs the module again.
                hooks = [layer.self_attn.register_forward_hook(lambda *_: attn_calls.__setitem__(0, attn_calls[0] + 1))
                         for layer in model.base_model.layers if hasattr(layer, "self_attn")]
                loss = sum(pipeline.train_step(dict(b), count, sync=defect == "reduce_every_micro_step" or i == 1)
                           .item() for i, b in enumerate(batches))
                for hook in hooks:
                    hook.remove()
                norm = stand_in.accelerator.clip_grad_norm_(model.parameters(), 0.5).item()
                eval_sum = pipeline.eval_token_sum(dict(batches[0])).item()  # no_grad: leaves the gradients
        finally:
            pp_trainer.reduce_stage_gradients, fsdp.shard_stages = original, original_shard
            chunked_loss.chunked_token_loss_sum = counted
        grads = {n: p.grad.full_tensor() if sharded else p.grad for n, p in model.named_parameters()
                 if p.grad is not None}  # under FSDP2 collective over the stage's ranks
        out.append({"loss": loss, "norm": norm, "grads": grads if plugin.state.cp_rank == 0 else {},
                    "eval": eval_sum, "chunk_calls": chunk_calls[0],
                    "attn_calls": attn_calls[0], "describe": pipeline.describe()})
    return out


# FSDP2 under a schedule of one stage a rank (1F1B) and of two (LoopedBFS); GPipe and Interleaved1F1B
# run the same stage code (the Trainer's FSDP2 run is Interleaved1F1B); the zero-bubble ones are refused.
# The chunked loss and gradient checkpointing (PyTorch's default non-reentrant one; the reentrant one,
# which accumulates the layers' weight gradients inside the input-gradient pass) alone and together,
# with FSDP2, and under a zero-bubble schedule (its backward split into input- and weight-gradient
# actions, each of which recomputes a checkpointed layer).
TRAINER_CASES = [("1F1B", False, None, ()), ("1F1B", False, "flat_over_world", ()),
                 ("1F1B", False, "reduce_every_micro_step", ()), ("1F1B", False, "scale_grads", ()),
                 ("1F1B", True, None, ()), ("1F1B", True, "fsdp_mean", ()), ("LoopedBFS", True, None, ()),
                 ("1F1B", False, None, ("chunked",)), ("1F1B", False, None, ("checkpointing",)),
                 ("1F1B", False, None, ("reentrant", "chunked")), ("1F1B", True, None, ("checkpointing", "chunked")),
                 ("InterleavedZeroBubble", False, None, ("checkpointing", "chunked"))]


def test_the_trainer_step_matches_one_process_and_planted_defects_are_caught():
    """``TrainerPipeline``'s step (what RingTrainer runs under PP), without and with FSDP2 inside
    the stages, in float64 on the shared world of 4: loss, whole-model norm and every clipped
    gradient as one process's (1e-10; the loss 1e-6: hf_ring's cross-entropy sums in float32).
    Each planted defect is caught, by a margin far outside those tolerances and the runs'
    1e-4: the gradients summed over the whole world, reduced at every accumulation micro-step,
    scaled by the micro-batch count a second time (the schedule's default scale_grads=True),
    or averaged over the stage (FSDP2's default divide factor). The
    clipping rescales a gradient scaled by a constant back to norm 0.5, so the norm (the
    logged grad_norm) is what catches those.

    With the chunked loss on the last stage and gradient checkpointing inside the stages
    (alone and together; with FSDP2; under a zero-bubble schedule, whose split backward
    recomputes a checkpointed layer in each of its two actions) the same tolerances hold
    against the one process's full logits and uncheckpointed layers: the chunks compute the
    same float32 cross-entropy per token, the recompute the same layer (measured 2026-12-07:
    gradients 7.0e-16, FSDP2 6.2e-16, norm 1.2e-16, loss 1.4e-7, as without). That they ran is
    checked too: the chunked loss called on the last stage's ranks only, and each checkpointed
    layer's attention run again in the backward. The first batch evaluated after the step
    (forward only through the stages) sums to one process's token losses (1e-6; 8.5e-8)."""
    from closeness import max_rel
    from distributed import run_world
    from test_pipeline_cp import LOSS_TOL, ROWS, TOL, _model

    from hf_ring.training.loss import token_loss_sum

    model, total, count, first_batch = _model(torch.float64, "sdpa"), 0.0, 0, 0.0
    for i, row in enumerate(ROWS):
        ids = torch.tensor([row])
        shift = torch.full_like(ids, -100)
        shift[:, :-1] = ids[:, 1:]
        total, count = total + token_loss_sum(model(input_ids=ids).logits, shift), count + int(shift.ne(-100).sum())
        if i == 1:  # rows 0 and 1: the batch evaluated after the step (the weights unchanged)
            first_batch = total.item()
    (total / count).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
    want = {n: p.grad for n, p in model.named_parameters()}
    results = run_world(4, _trainer_step_case, TRAINER_CASES)
    plain_attn = [r[0]["attn_calls"] for r in results]  # no checkpointing: each layer's attention once a forward
    for i, (schedule, sharded, defect, options) in enumerate(TRAINER_CASES):
        got = {}
        for r in results:
            got.update(r[i]["grads"])
        assert sorted(got) == sorted(want)
        grad = max(max_rel(got[n], want[n]) for n in want)
        norm = max(abs(r[i]["norm"] - want_norm) / want_norm for r in results)
        loss = max(abs(r[i]["loss"] - (total / count).item()) / (total / count).item() for r in results)
        # Every stage's eval sum is its CP shard's (handed over the pp group): ranks 0, 1 hold both shards.
        evaluated = abs(sum(r[i]["eval"] for r in results[:2]) - first_batch) / first_batch
        print(f"{schedule}{', FSDP2' if sharded else ''}, {defect or 'no defect'}{', ' if options else ''}"
              f"{', '.join(options)}: gradients {grad:.1e}, norm {norm:.1e}, loss {loss:.1e}, eval {evaluated:.1e}")
        # The chunked loss ran on the last stage's ranks (2 micro-batches x 2 micro-steps, and the eval's 2), and
        # only there; a checkpointed layer's attention ran again in the backward (more under a split backward).
        assert [r[i]["chunk_calls"] for r in results] == ([0, 0, 6, 6] if "chunked" in options else [0, 0, 0, 0])
        assert ("chunked on the last stage" in results[0][i]["describe"]) == ("chunked" in options)
        checkpointed = "checkpointing" in options or "reentrant" in options
        for r, plain in zip(results, plain_attn):
            assert r[i]["attn_calls"] >= 2 * plain if checkpointed else r[i]["attn_calls"] == plain, (options, r[i])
        if defect is None:
            assert grad < TOL and norm < TOL and loss < LOSS_TOL and want_norm > 0.5  # the clipping ran
            assert evaluated < LOSS_TOL
        else:
            assert max(grad, norm) > 0.1, defect


# ---- refusals, in process ----


def _trainer(**changes):
    """A stand-in for a Ring trainer under pp 2 x cp 2 with nothing refused (``changes`` plant one)."""
    from hf_ring import ContextParallelState
    from hf_ring.distributed.groups import BUILT_AXES, AxisGroup, ProcessMesh
    from hf_ring.distributed.mesh import ParallelDims

    dims = ParallelDims(changes.pop("world", 4), cp=2, pp=2, tp=changes.pop("tp", 1))
    mesh = ProcessMesh(dims, {a: AxisGroup(None, dims.coord(a, 0), dims.size(a), dims.group_ranks(a, 0))
                              for a in BUILT_AXES})
    args = SimpleNamespace(fsdp="", gradient_checkpointing=False, torch_compile=False, save_strategy="steps",
                           load_best_model_at_end=False)
    trainer = SimpleNamespace(ring_state=ContextParallelState(mesh), args=args, model=torch.nn.Linear(2, 2),
                              accelerator=SimpleNamespace(scaler=None, state=SimpleNamespace()),
                              chunked_loss=SimpleNamespace(enabled=None), eval_dataset=None,
                              ring_plugin=SimpleNamespace(pp_schedule="1F1B"), data_collator=None)
    args.gradient_checkpointing_kwargs = None  # TrainingArguments' default
    for key, value in changes.items():
        target = args if hasattr(args, key) else trainer
        setattr(target, key, value)
    return trainer


@pytest.mark.parametrize("change,subclass_loss,match", [
    ({}, True, r"a loss of the trainer's own \(the TRL trainers"),
    ({"tp": 2, "world": 8}, False, r"tensor parallelism inside a stage \(tp_size=2\)"),
    ({"fsdp": "full_shard"}, False, r"TrainingArguments' fsdp .*RingAttentionPlugin\(pp_fsdp=True\)"),
    ({"is_deepspeed_enabled": True}, False, "TrainingArguments' fsdp .* or DeepSpeed"),
    ({"torch_compile": True}, False, "torch.compile of the stages"),
    ({"load_best_model_at_end": True}, False, r"load_best_model_at_end .*from_pretrained after training"),
    ({"eval_dataset": [1], "ring_plugin": SimpleNamespace(pp_schedule="ZBVZeroBubble")}, False,
     "evaluation under ZBVZeroBubble"),
    ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True},
      "ring_plugin": SimpleNamespace(pp_schedule="InterleavedZeroBubble")}, False,
     r"reentrant gradient checkpointing \(use_reentrant=True\) under pp_schedule='InterleavedZeroBubble'"),
])
def test_what_the_stages_do_not_compose_is_refused_by_name(change, subclass_loss, match):
    from hf_ring.training.pp.checks import check_pipeline_trainer

    check_pipeline_trainer(_trainer(), subclass_loss=False)  # the stand-in itself passes
    with pytest.raises(NotImplementedError, match=r"with pipeline parallelism \(pp_size=2\): " + match):
        check_pipeline_trainer(_trainer(**change), subclass_loss=subclass_loss)


def test_gradient_checkpointing_and_the_chunked_loss_pass_the_checks():
    """Composed (the step above checks them against one process): not refused, the reentrant
    checkpoint under a schedule that runs the whole backward at once (1F1B) included."""
    from hf_ring.training.pp.checks import check_pipeline_trainer

    for kwargs in (None, {"use_reentrant": False}, {"use_reentrant": True}):
        trainer = _trainer(gradient_checkpointing=True, chunked_loss=SimpleNamespace(enabled=True))
        trainer.args.gradient_checkpointing_kwargs = kwargs
        check_pipeline_trainer(trainer, subclass_loss=False)
    trainer = _trainer(gradient_checkpointing=True, ring_plugin=SimpleNamespace(pp_schedule="ZBVZeroBubble"))
    trainer.args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    check_pipeline_trainer(trainer, subclass_loss=False)


def test_fsdp_inside_a_stage_refuses_what_it_does_not_compose():
    from hf_ring.pipeline.fsdp import stage_mesh

    import hf_ring

    with pytest.raises(ValueError, match="True only with pp_size > 1"):
        hf_ring.RingAttentionPlugin(cp_size=2, pp_fsdp=True)
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        with pytest.raises(NotImplementedError, match=f"pp_fsdp=True.*{schedule}' is not composed"):
            hf_ring.RingAttentionPlugin(cp_size=2, pp_size=2, pp_schedule=schedule, pp_fsdp=True)
    with pytest.raises(NotImplementedError, match=r"tp_size=2 are not composed with it yet"):
        stage_mesh(_trainer(tp=2, world=8).ring_state, "cpu")


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
    assert finetune_llama_long.parse_args([*base, "--fsdp", "full_shard"]).fsdp == "full_shard"  # pp_fsdp
    assert finetune_llama_long.parse_args([*base, "--chunked_loss", "on"]).chunked_loss == "on"  # the last stage's
    for extra in (["--tp_size", "2"], ["--fsdp", "hybrid_shard"], ["--lora_r", "4"], ["--offload_checkpoints"],
                  ["--cp_pattern", "ulysses"], ["--pp_microbatches", "3"],
                  ["--fsdp", "full_shard", "--pp_schedule", "InterleavedZeroBubble"]):
        with pytest.raises(SystemExit):
            finetune_llama_long.parse_args([*base, *extra])
