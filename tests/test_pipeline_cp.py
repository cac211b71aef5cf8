"""Pipeline parallelism beside context parallelism: pp 2 x cp 2 on 4 gloo processes, trained by
PyTorch's schedules (``hf_ring.pipeline``), against one process on the full sequence.

The mesh is ``pp, dp, cp``: ranks {0, 1} are stage 0's CP group, {2, 3} stage 1's; the
pipeline groups are {0, 2} and {1, 3}. A tiny Llama (4 decoder layers, untied embeddings) is
cut into 2 stages (GPipe, 1F1B) or 4 (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble: two a rank, one layer each), and one
step runs over a batch of 4 rows in 2 micro-batches: padded rows of different lengths, and
packed rows (each micro-batch its own packed row of two documents, the shorter row filled
with a padding document). The reference is one process, SDPA attention, each row (packed:
each document) alone on its full sequence; its loss is the token mean over the whole batch.

Compared: the step's loss (the last stage's micro-batch shares summed over micro-batches
and its CP group) and every parameter's gradient (each summed over its stage's CP group,
gathered from both stages: every parameter of the model is compared once). In float64, so
the tolerance 1e-10 on the gradients, relative to the largest value, checks the arithmetic
exactly (measured: 5.6e-16 padded, 6.5e-16 packed, every schedule). The loss's value is
hf_ring's token loss, whose cross-entropy sums in float32 whatever the model's dtype: 1e-6
relative (measured 0 padded, 1.1e-7 packed). The defect below is 0.5 off.

Planted defects, each shown to fail: the schedule's default ``scale_grads=True`` (every
gradient divided by the micro-batch count: half of one process's), and a CP group built
across the stages (ranks {0, 2}: each "stage" would ring with a rank holding other layers).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_world

VOCAB, LAYERS = 64, 4
ROWS = ([5, 9, 3, 12, 7, 30, 2, 8, 11, 6, 4], [17, 3, 8, 25, 1, 9, 14], [2, 2, 7, 41, 13, 5, 6, 19, 23, 8, 1, 10, 3],
        [33, 12, 4, 9, 18, 6, 2, 27, 15])
TOL = 1e-10  # float64 gradients: relative to the largest value
# The loss itself: hf_ring's token loss sums cross-entropies in float32 whatever the dtype, so
# its value is float32 arithmetic summed in another order (per micro-batch, per CP shard).
LOSS_TOL = 1e-6


def _model(dtype: torch.dtype, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation=attn)
    return LlamaForCausalLM(config).to(dtype)


def _reference(dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, each row alone on its full sequence: the token-mean loss over the batch
    and every gradient."""
    from hf_ring.training.loss import token_loss_sum

    model = _model(dtype, "sdpa")
    total, count = 0.0, 0
    for row in ROWS:
        ids = torch.tensor([row])
        shift = torch.full_like(ids, -100)
        shift[:, :-1] = ids[:, 1:]
        total = total + token_loss_sum(model(input_ids=ids).logits, shift)
        count += int(shift.ne(-100).sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


class _DefaultScaling:
    """The planted defect: the schedules built with PyTorch's default ``scale_grads=True``
    (every gradient divided by the micro-batch count), restored after the case."""

    def __enter__(self):
        from hf_ring.pipeline import schedule

        self.module, self.original = schedule, schedule.schedule_class

        def defective(name):
            cls = self.original(name)
            return type(cls.__name__, (cls,), {"__init__": lambda s, *a, **k: cls.__init__(s, *a, **{
                **k, "scale_grads": True})})

        schedule.schedule_class = defective

    def __exit__(self, *exc):
        self.module.schedule_class = self.original


def _pipeline_case(rank: int, world: int, schedule: str, packed: bool, dtype: torch.dtype, defect: bool) -> dict:
    """One step at pp 2 x cp 2 on this rank: the step's loss (on the last stage's ranks, else
    None) and this stage's gradients summed over its CP group (from its CP rank 0)."""
    import contextlib

    import torch.distributed as dist

    import hf_ring
    from hf_ring.pipeline import PipelineRunner
    from hf_ring.pipeline.microbatches import packed_micro_batches
    from hf_ring.training.loss import all_reduce_sum, count_valid_tokens

    state = hf_ring.setup_context_parallel(2, pp_size=2)
    model = _model(dtype, "ring_flash")
    with _DefaultScaling() if defect else contextlib.nullcontext():
        runner = PipelineRunner(model, state, schedule=schedule, n_microbatches=2)
        collate = hf_ring.RingDataCollator(0, cp_size=2, cp_rank=state.cp_rank, packing=packed)
        features = [{"input_ids": r} for r in ROWS]
        batch = packed_micro_batches(collate, features, 2, collate.config.multiple, 0) if packed else collate(features)
        count = all_reduce_sum(count_valid_tokens(batch["shift_labels"]), state.loss_group)
        loss = runner.step(batch, count)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=state.loss_group)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": None if loss is None else all_reduce_sum(loss, state.loss_group).item(),
            "grads": grads if state.cp_rank == 0 else {}, "stages": runner.stage_ids, "cp_ranks": state.cp_ranks}


def _compare(results: list[dict], dtype: torch.dtype) -> tuple[float, float]:
    """The loss's and the worst gradient's error against one process (relative to the largest
    value), after checking the mesh and that every parameter came back exactly once."""
    from closeness import max_rel

    want_loss, want = _reference(dtype)
    assert [r["cp_ranks"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 2 and losses[0] == losses[1]
    got = {}
    for r in results:
        assert not set(r["grads"]) & set(got), "a parameter came back from two stages"
        got.update(r["grads"])
    assert sorted(got) == sorted(want)
    return abs(losses[0] - want_loss) / abs(want_loss), max(max_rel(got[n], want[n]) for n in want)


# Every schedule hf_ring runs (hf_ring.pipeline.SCHEDULES): one stage a rank (GPipe, 1F1B) or two
# (looped, interleaved, zero-bubble; ZBV in its V placement), padded and packed.
CASES = [(s, p) for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
         for p in (False, True)]


@pytest.mark.parametrize("schedule,packed", CASES, ids=[f"{s}-{'packed' if p else 'padded'}" for s, p in CASES])
def test_pp2_cp2_matches_one_process(schedule, packed):
    """Every gradient within 1e-10 (float64) of one process, the loss within 1e-6."""
    loss_err, grad_err = _compare(run_world(4, _pipeline_case, schedule, packed, torch.float64, False), torch.float64)
    print(f"{schedule} {'packed' if packed else 'padded'}: loss {loss_err:.1e}, worst gradient {grad_err:.1e}")
    assert loss_err < LOSS_TOL and grad_err < TOL


def test_default_gradient_scaling_is_caught():
    """PyTorch's default scale_grads=True halves every gradient at 2 micro-batches: caught."""
    loss_err, grad_err = _compare(run_world(4, _pipeline_case, "1F1B", False, torch.float64, True), torch.float64)
    print(f"scale_grads=True: loss {loss_err:.1e}, worst gradient {grad_err:.2f}")
    assert loss_err < LOSS_TOL and grad_err > 0.4


def test_every_cp_group_lies_inside_one_stage():
    """pp outermost: at pp 2 x cp 2 (x tp 2) every CP and TP group is inside one stage's block
    of consecutive ranks; a pipeline group holds one rank of each stage."""
    from hf_ring.distributed.mesh import ParallelDims

    for dims in (ParallelDims(4, cp=2, pp=2), ParallelDims(8, cp=2, tp=2, pp=2), ParallelDims(8, cp=2, pp=2)):
        block = dims.world_size // dims.pp
        for axes in ("cp", "tp", "loss", "batch"):
            for group in dims.all_groups(axes):
                assert len({r // block for r in group}) == 1, (dims, axes, group)
        for group in dims.all_groups("pp"):
            assert [r // block for r in group] == list(range(dims.pp))


def test_layer_split():
    from hf_ring.pipeline import parse_pp_layers, stage_layer_ranges, stages_of_rank

    assert stage_layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert stage_layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]  # transformers' rule: the remainder first
    assert stage_layer_ranges(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    assert stages_of_rank(1, 2, 2) == [1, 3] and stages_of_rank(1, 2, 2, v_shape=True) == [1, 2]
    assert parse_pp_layers("3,5") == [3, 5] and parse_pp_layers("") is None
    with pytest.raises(ValueError, match="holds 3 decoder layers, but the model has 4"):
        stage_layer_ranges(4, 2, [1, 2])
    with pytest.raises(ValueError, match="for each of the 3 stages"):
        stage_layer_ranges(4, 3, [2, 2])
    with pytest.raises(ValueError, match="need at least one decoder layer each"):
        stage_layer_ranges(3, 4)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_pp_layers("3;5")


def test_schedule_names_and_stages_per_rank():
    from hf_ring.pipeline import schedule_class, stages_per_rank_of

    assert schedule_class("1F1B").__name__ == "Schedule1F1B"
    assert stages_per_rank_of("GPipe") == 1 and stages_per_rank_of("Interleaved1F1B") == 2
    assert stages_per_rank_of("Interleaved1F1B", 3) == 3
    with pytest.raises(ValueError, match="is not one of the schedules hf_ring runs"):
        schedule_class("1f1b_home_made")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        stages_per_rank_of("1F1B", 2)
    with pytest.raises(ValueError, match="needs exactly 2 stages per rank"):
        stages_per_rank_of("ZBVZeroBubble", 3)


def test_what_is_not_composed_is_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ring.pipeline.microbatches import deal
    from hf_ring.pipeline.refusals import check_pipeline_model

    check_pipeline_model(_model(torch.float32, "sdpa"))
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, tie_word_embeddings=True))
    with pytest.raises(NotImplementedError, match="tied input and output embeddings.*tie_word_embeddings=False"):
        check_pipeline_model(tied)
    with pytest.raises(NotImplementedError, match="without a causal LM head"):
        check_pipeline_model(tied.model)
    routed = _model(torch.float32, "sdpa")
    routed.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="router's load-balancing loss"):
        check_pipeline_model(routed)
    with pytest.raises(ValueError, match="multiple of pp_microbatches"):
        deal([1, 2, 3], 2)


def _training_case(rank: int, world: int, schedule: str, packed: bool, steps: int) -> dict:
    """``steps`` optimizer steps (SGD, the gradient clipped to norm 0.5) at pp 2 x cp 2 through the
    plugin, in a loop of one's own: every step's whole-model gradient norm, and the weights after."""
    import hf_ring
    from hf_ring.pipeline import clip_pipeline_grad_norm_, reduce_stage_gradients
    from hf_ring.training.loss import count_valid_tokens

    plugin = hf_ring.RingAttentionPlugin(cp_size=2, pp_size=2, pp_schedule=schedule, pp_microbatches=2)
    model = _model(torch.float64, "ring_flash")
    runner = plugin.make_pipeline(model)
    collate = plugin.make_collator(pad_token_id=0, packing=packed)  # packed: each micro-batch its own row
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    norms, losses = [], []
    for step in range(steps):
        features = [{"input_ids": r[step:]} for r in ROWS]
        batch = collate(features)
        loss = runner.step(batch, plugin.global_token_count(count_valid_tokens(batch["shift_labels"])))
        reduce_stage_gradients(model.parameters(), plugin.state)
        norms.append(clip_pipeline_grad_norm_(model.parameters(), 0.5, plugin.state).item())
        losses.append(None if loss is None else plugin.global_token_count(loss).item())
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()} if plugin.state.cp_rank == 0 else {}
    return {"norms": norms, "losses": losses, "weights": weights, "describe": plugin.describe()}


def _training_reference(steps: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    from hf_ring.training.loss import token_loss_sum

    model = _model(torch.float64, "sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    norms, losses = [], []
    for step in range(steps):
        total, count = 0.0, 0
        for row in ROWS:
            ids = torch.tensor([row[step:]])
            shift = torch.full_like(ids, -100)
            shift[:, :-1] = ids[:, 1:]
            total = total + token_loss_sum(model(input_ids=ids).logits, shift)
            count += int(shift.ne(-100).sum())
        (total / count).backward()
        losses.append((total / count).item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms, losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule,packed", [("Interleaved1F1B", False), ("1F1B", True)])
def test_a_training_loop_through_the_plugin_matches_one_process(schedule, packed):
    """Two SGD steps with the gradient clipped: every step's loss (1e-6) and whole-model
    gradient norm, and every weight after (1e-10, float64), against one process."""
    from closeness import max_rel

    results = run_world(4, _training_case, schedule, packed, 2)
    norms, losses, weights = _training_reference(2)
    assert "pp_rank 1/2" in results[3]["describe"]
    got = {}
    for r in results:
        got.update(r["weights"])
        assert max(abs(a - b) / b for a, b in zip(r["norms"], norms)) < TOL
        assert r["losses"][0] is None or max(abs(a - b) / b for a, b in zip(r["losses"], losses)) < LOSS_TOL
    assert norms[0] > 0.5  # the clipping ran
    worst = max(max_rel(got[n], weights[n]) for n in weights)
    print(f"{schedule} {'packed' if packed else 'padded'}, 2 steps: worst weight {worst:.1e}")
    assert sorted(got) == sorted(weights) and worst < TOL


def test_the_trl_trainers_refuse_pipeline_parallelism_by_name():
    """RingTrainer runs under pp_size > 1 (tests/test_trainer_pp.py); a trainer with a loss of
    its own (the TRL trainers) is refused by name."""
    from types import SimpleNamespace

    from hf_ring import ContextParallelState
    from hf_ring.distributed.groups import BUILT_AXES, AxisGroup, ProcessMesh
    from hf_ring.distributed.mesh import ParallelDims
    from hf_ring.training.trainer_checks import check_trainer_supported

    dims = ParallelDims(4, cp=2, pp=2)
    mesh = ProcessMesh(dims, {a: AxisGroup(None, dims.coord(a, 0), dims.size(a), dims.group_ranks(a, 0))
                              for a in BUILT_AXES})
    trainer = SimpleNamespace(ring_state=ContextParallelState(mesh), args=None)
    with pytest.raises(NotImplementedError, match=r"pipeline parallelism \(pp_size=2\): a loss of the trainer's own "
                                                  r"\(the TRL trainers"):
        check_trainer_supported(trainer, subclass_loss=True)
