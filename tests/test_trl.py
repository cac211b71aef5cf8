"""hf_ring.trl: TRL's SFT and DPO trainers under context parallelism compute what they compute without it.

Runs examples/sft_long.py and examples/dpo_long.py for real (float32, fixed seed) with
`accelerate launch`, 2 processes forming one CP group, and compares every figure the
Trainer logs (trainer_state.json) at each of 8 optimizer steps, and each evaluation, with
one process at cp_size 1 on the same global batches (batch 2 x accumulation 2):

    SFT, padded rows: conversations through a chat template, assistant-only loss
    SFT, packed rows: prompt-completion text (completion-only loss), TRL's best-fit packing,
        which hf_ring turns into per-document zigzag packing
    DPO: conversational preference pairs, sigmoid loss, a reference model

(the packed SFT and the DPO CP runs with gradient checkpointing, TRL's default), the padded
SFT once more with its weights sharded by FSDP2 over the CP group, and DPO with FSDP2 and with
ZeRO-3 (measured: every figure within 1.3e-6 of cp 1, most below 5e-7).

Compared: loss, grad_norm, eval_loss and every metric TRL logs (SFT: entropy,
mean_token_accuracy, num_tokens; DPO: rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/*, logits/*, entropy, mean_token_accuracy,
num_tokens), train and eval. Equal values after 8 AdamW steps also mean equal gradients.
The cp_size 1 SFT trainer is itself checked against TRL's own SFTTrainer (in-process).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys

import pytest
import torch

from sft_cases import sft_trainer
from test_trainer_cp import ROOT, _run
from closeness import fake_cp_state

EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 8
# float32 on CPU; the CP runs reduce the same sums in another order (over 2 shards, through
# the ring's online softmax). Measured differences are ~1e-6 of the value; 1e-4 leaves room
# for the other order of 8 AdamW steps while catching any real error (a wrong mask or a
# per-shard mean is off by 1e-2 or more). Values of size below 1 are held to 1e-4 absolute.
TOL = 1e-4
COMMON = [
    "--seq_len", "256", "--max_steps", str(STEPS), "--seed", "3", "--gradient_accumulation_steps", "2",
    "--per_device_train_batch_size", "2", "--num_train_examples", "64", "--num_eval_examples", "8",
    "--eval_steps", "4", "--learning_rate", "1e-3", "--hidden_size", "64", "--disable_tqdm",
]
CONFIGS = {
    "sft_padded": ("sft_long.py", ["--dataset_format", "messages"]),
    "sft_packed": ("sft_long.py", ["--dataset_format", "prompt_completion", "--packing"]),
    # TRL's packed rows placed by length (the short documents whole on a rank): cp 2 only,
    # against sft_packed at cp 1.
    "sft_packed_by_length": ("sft_long.py", ["--dataset_format", "prompt_completion", "--packing",
                                             "--cp_placement", "by_length"]),
    "dpo": ("dpo_long.py", []),
}
# Gradient checkpointing (TRL's default) in the CP run only: it recomputes the ring in the backward.
CP_ONLY = {"sft_packed": ["--gradient_checkpointing"], "sft_packed_by_length": ["--gradient_checkpointing"],
           "dpo": ["--gradient_checkpointing"]}
# Figures that measure time or padded work (total_flos counts padding), not training.
_NOT_COMPARED = ("runtime", "per_second", "total_flos")


def _launch(script: str, cp_size: int, out_dir: str, args: list[str], expect: tuple[str, ...] = ()) -> dict:
    log = _run(cp_size, [os.path.join(EXAMPLES, script), "--output_dir", out_dir, "--cp_size", str(cp_size),
                         *COMMON, *args])
    for line in (f"[hf_ring] rank {cp_size - 1}/{cp_size} (dist_backend", *expect):
        assert line in log, (line, log[-3000:])
    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        return json.load(f)


def _figures(state: dict) -> dict[tuple[int, str], float]:
    """Every logged number of the run, keyed by (step, name); the final evaluation repeats the last."""
    out = {}
    for entry in state["log_history"]:
        for name, value in entry.items():
            if name in ("step", "epoch") or any(t in name for t in _NOT_COMPARED) or name.startswith("train_"):
                continue
            out[(entry["step"], name)] = float(value)
    return out


def compare(got: dict, ref: dict, tol: float = TOL) -> dict[str, float]:
    """Max |got - ref| per figure name; asserts every figure within ``tol`` relative (absolute
    below 1; default TOL, see above)."""
    g, r = _figures(got), _figures(ref)
    assert sorted(g) == sorted(r), (sorted(set(g) ^ set(r)))
    worst: dict[str, float] = {}
    for key, value in r.items():
        step, name = key
        assert math.isfinite(g[key]) and math.isfinite(value), (key, g[key], value)
        diff = abs(g[key] - value)
        assert diff <= tol * max(1.0, abs(value)), f"{name} at step {step}: {g[key]} vs {value} (reference)"
        worst[name] = max(worst.get(name, 0.0), diff)
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[tuple[str, int], dict] = {}

    def get(name: str, cp_size: int) -> dict:
        if (name, cp_size) not in cache:
            script, args = CONFIGS[name]
            args = args + (CP_ONLY.get(name, []) if cp_size > 1 else [])
            cache[(name, cp_size)] = _launch(script, cp_size, str(tmp_path_factory.mktemp(f"{name}_cp{cp_size}")), args)
        return cache[(name, cp_size)]

    return get


def test_sft_with_fsdp2_logs_what_cp1_logs(runs, tmp_path):
    """Weights sharded by FSDP2 over the CP group: the loss share is multiplied by the mesh's
    size (read from the wrapped model), and every figure matches one process."""
    script, args = CONFIGS["sft_padded"]
    got = _launch(script, 2, str(tmp_path / "fsdp"), args + ["--fsdp", "full_shard"],
                  expect=("gradients: fsdp2 mesh (2,) over 2 processes",))
    worst = compare(got, runs("sft_padded", 1))
    assert {"loss", "grad_norm", "eval_loss"} <= set(worst)
    print("\nsft_padded, FSDP2 cp2: max |cp2 - cp1| per figure: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))


@pytest.mark.parametrize("sharding, expect", [
    (["--fsdp", "full_shard"], "gradients: fsdp2 mesh (2,) over 2 processes"),
    (["--deepspeed", os.path.join(EXAMPLES, "ds_zero3.json")], "DeepSpeed engine, ZeRO stage 3: 21/21 parameters"),
], ids=["fsdp2", "zero3"])
def test_dpo_with_sharded_weights_logs_what_cp1_logs(runs, tmp_path, sharding, expect):
    """The policy's (and, under ZeRO-3, the reference's) weights sharded over the CP group:
    the gathered log-probabilities' backward gives each rank cp_size times its share, which
    the wrapper's average over the processes makes the gradient of one process."""
    if "--deepspeed" in sharding:
        pytest.importorskip("deepspeed")
    got = _launch("dpo_long.py", 2, str(tmp_path / "dpo"), sharding, expect=(expect,))
    worst = compare(got, runs("dpo", 1))
    assert {"loss", "grad_norm", "eval_loss", "rewards/margins"} <= set(worst)
    print(f"\ndpo, {sharding[0]} cp2: max |cp2 - cp1| per figure: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - {"sft_packed_by_length"}))
def test_cp2_logs_what_cp1_logs(runs, name):
    ref, got = runs(name, 1), runs(name, 2)
    steps = sorted({e["step"] for e in ref["log_history"] if "loss" in e})
    assert steps == list(range(1, STEPS + 1))
    assert sum(1 for e in ref["log_history"] if "eval_loss" in e) >= 2
    worst = compare(got, ref)
    expected = {"loss", "grad_norm", "eval_loss", "entropy", "mean_token_accuracy", "num_tokens"}
    if name == "dpo":
        expected |= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                     "logps/rejected", "eval_rewards/margins", "eval_rewards/accuracies"}
    assert expected <= set(worst), sorted(expected - set(worst))
    print(f"\n{name}: max |cp2 - cp1| per figure over {STEPS} steps: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
    if name.startswith("sft"):
        losses = [e["loss"] for e in ref["log_history"] if "loss" in e]
        assert losses[-1] < losses[0]  # it learns (DPO's per-batch loss is too noisy: see the next test)


def test_sft_packed_rows_placed_by_length_log_what_cp1_logs(runs):
    """Every figure TRL logs (loss, grad_norm, eval_loss, entropy, token accuracy, tokens) at cp 2
    with TRL's packed rows placed by length equals the cp 1 run's."""
    worst = compare(runs("sft_packed_by_length", 2), runs("sft_packed", 1))
    assert {"loss", "grad_norm", "eval_loss", "mean_token_accuracy", "num_tokens"} <= set(worst)


def test_trainers_that_pack_their_own_rows_refuse_placement_by_length():
    from closeness import fake_cp_state
    from hf_ring.training.trainer_checks import refuse_placement

    refuse_placement(fake_cp_state(), "RingDPOTrainer", "its rows")  # sharded: nothing to refuse
    with pytest.raises(NotImplementedError, match="RingDPOTrainer packs its rows itself.*placement='sharded'"):
        refuse_placement(fake_cp_state(placement="by_length"), "RingDPOTrainer", "its rows")


def test_dpo_rewards_move(runs):
    """The DPO comparison is not one of zeros: rewards and margins are non-zero after step 1."""
    ref = runs("dpo", 1)
    margins = [e["rewards/margins"] for e in ref["log_history"] if "rewards/margins" in e]
    assert margins[0] == 0.0 and any(abs(m) > 1e-3 for m in margins[1:]), margins


# ---- in one process: TRL itself as the reference, the collator, the refusals ----


@pytest.fixture
def fresh_process_state():
    from accelerate.state import AcceleratorState

    import hf_ring

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    hf_ring.set_context_parallel_state(None)


@pytest.mark.parametrize("fmt,packing", [("messages", False), ("prompt_completion", True)])
def test_ring_sft_at_cp1_is_trl_sft(tmp_path, fresh_process_state, fmt, packing):
    """RingSFTTrainer at cp_size 1 logs what TRL's own SFTTrainer logs (its loss is its own code,
    so this is the check that the masks, the packing and the metrics mean what TRL means).
    RingSFTTrainer logs one figure more, eval_token_loss (the token mean over the eval set)."""
    from trl import SFTTrainer

    from hf_ring import RingAttentionPlugin
    from hf_ring.trl import RingSFTTrainer

    results = {}
    for name, cls, kwargs in (("trl", SFTTrainer, {}), ("ring", RingSFTTrainer, {"ring_plugin": RingAttentionPlugin()})):
        trainer = sft_trainer(cls, fmt, packing, str(tmp_path / name), **kwargs)
        trainer.train()
        trainer.evaluate()
        results[name] = {"log_history": [{k: v for k, v in e.items()} for e in trainer.state.log_history]}
    extra = [e.pop("eval_token_loss") for e in results["ring"]["log_history"] if "eval_token_loss" in e]
    assert extra and all(math.isfinite(v) for v in extra)
    worst = compare(results["ring"], results["trl"])
    assert {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss"} <= set(worst)


def _learned(batch: dict) -> list[tuple[int, int, int]]:
    """(position in its document, token, the token it learns to predict) for every learned pair."""
    ids, pos, target = batch["input_ids"][0], batch["position_ids"][0], batch["shift_labels"][0]
    return [(int(p), int(i), int(t)) for p, i, t in zip(pos, ids, target) if t != -100]


def test_packed_batches_keep_trl_documents_apart():
    """A TRL-packed batch (rows of several documents, ``seq_lengths``) becomes hf_ring's packing:
    one document per entry of cu_seq_lens, each learning exactly what TRL's padding-free
    collator has it learn (no document's last token learns the next one's first)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_ring import RingDataCollator
    from hf_ring.sharding import unshard_packed
    from hf_ring.trl import RingSFTCollator

    rows = [
        {"input_ids": [11, 12, 13, 14, 15, 16, 17], "labels": [-100, 12, 13, -100, -100, 16, 17], "seq_lengths": [3, 4]},
        {"input_ids": [21, 22, 23, 24, 25], "labels": [21, 22, 23, 24, 25], "seq_lengths": [5]},
    ]
    trl_batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    trl_pairs = [
        (int(p), int(i), int(t))
        for p, i, t in zip(trl_batch["position_ids"][0][:-1], trl_batch["input_ids"][0][:-1], trl_batch["labels"][0][1:])
        if t != -100
    ]
    one = RingSFTCollator.for_trl(fake_cp_state(0, 1), pad_token_id=0, padding_free=True)(rows)
    assert _learned(one) == trl_pairs
    assert one["cu_seq_lens_q"].tolist() == [0, 4, 8, 14]  # three documents, each padded to a multiple of 2
    assert one["hf_ring_num_tokens"] == 12
    # Under CP each rank holds its zigzag shard of every document; together they are the cp=1 row.
    docs = []
    for row in rows:
        ends = list(itertools.accumulate(row["seq_lengths"]))
        docs += [{"input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]} for a, b in zip([0, *ends], ends)]
    shards = [RingSFTCollator.for_trl(fake_cp_state(r, 2), pad_token_id=0, padding_free=True)(rows) for r in range(2)]
    for r, shard in enumerate(shards):
        direct = RingDataCollator(0, cp_size=2, cp_rank=r, packing=True)(docs)
        for key, value in direct.items():
            assert torch.equal(torch.as_tensor(shard[key]), torch.as_tensor(value)), key
    cu = shards[0]["cu_seq_lens_q"]
    full = unshard_packed([s["shift_labels"] for s in shards], cu)
    two = {"input_ids": unshard_packed([s["input_ids"] for s in shards], cu),
           "position_ids": unshard_packed([s["position_ids"] for s in shards], cu), "shift_labels": full}
    assert _learned(two) == trl_pairs


def test_refuses_unsupported_trl_versions(monkeypatch):
    import trl

    from hf_ring.patches import trl as trl_patches

    with pytest.raises(trl_patches.UnsupportedTRLVersion, match=r"1\.16\.0"):
        trl_patches.check_version("1.15.2")
    assert trl_patches.check_version("1.16.0") == "1.16.0"
    assert trl_patches.check_version("1.17.0") == "1.17.0"  # newer 1.x: one warning (tests/test_versions.py)
    # hf_ring.trl is the face of hf_ring.training.trl, whose import runs the check: both are imported afresh.
    packages = ("hf_ring.trl", "hf_ring.training.trl")
    saved = {k: v for k, v in sys.modules.items() if k in packages or k.startswith(tuple(p + "." for p in packages))}
    monkeypatch.setattr(trl, "__version__", "2.0.0")
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(trl_patches.UnsupportedTRLVersion, match=r"does not know trl 2\.0\.0 \(tested 1\.16\.0, accepted: 1\.x\)"):
        import hf_ring.trl  # noqa: F401
    for name in [k for k in sys.modules if k in packages or k.startswith(tuple(p + "." for p in packages))]:
        sys.modules.pop(name)


def test_trl_accessors_of_internals(monkeypatch):
    import trl
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    from trl.trainer.utils import FusedCausalLMOutput

    from hf_ring.patches import trl as trl_patches

    class Trainer:
        def __init__(self) -> None:
            self.ref_model = "reference"

    trainer = Trainer()
    with pytest.raises(RuntimeError, match="inside"):
        with trl_patches.reference_model_replaced(trainer, "ring"):
            assert trainer.ref_model == "ring"
            raise RuntimeError("inside")
    assert trainer.ref_model == "reference"
    with pytest.raises(trl_patches.UnsupportedTRLVersion, match="no ref_model attribute"):
        with trl_patches.reference_model_replaced(object(), "ring"):
            pass
    assert trl_patches.language_modeling_collator_class() is DataCollatorForLanguageModeling
    assert trl_patches.fused_output_class() is FusedCausalLMOutput
    monkeypatch.setattr(trl, "__version__", "2.0.0")
    for call in (trl_patches.language_modeling_collator_class, trl_patches.fused_output_class,
                 lambda: trl_patches.reference_model_replaced(trainer, "ring").__enter__()):
        with pytest.raises(trl_patches.UnsupportedTRLVersion, match="2.0.0"):
            call()
    assert trainer.ref_model == "reference"


def _divides_by_tp_size(self):
    return self.tokens // self._tp_size


def _divides_by_another_name(self):
    return self.tokens // self._tensor_parallel_size


def test_trl_accessors_check_that_trl_still_reads_what_they_write(monkeypatch):
    import trl.trainer.utils

    from hf_ring.patches import trl as trl_patches

    def fake_trainer(compute_loss):
        # A class of a (fake) TRL module, as a newer TRL would define it.
        return type("DPOTrainer", (), {"__module__": "trl.fake", "compute_loss": compute_loss, "_tp_size": 1})()

    from trl import DPOTrainer

    # The installed TRL's DPO trainer is what set_batch_replicas is called on (RingDPOTrainer).
    trl_patches._check_reads(DPOTrainer, ("_compute_loss", "compute_loss"), "// self._tp_size", "reads it")
    trainer = fake_trainer(_divides_by_tp_size)
    trl_patches.set_batch_replicas(trainer, 2)
    assert trainer._tp_size == 2
    with pytest.raises(trl_patches.UnsupportedTRLVersion,
                       match=r"DPOTrainer._compute_loss / compute_loss no longer divides its token count by _tp_size"):
        trl_patches.set_batch_replicas(fake_trainer(_divides_by_another_name), 2)
    with pytest.raises(trl_patches.UnsupportedTRLVersion, match="is not a TRL trainer"):
        trl_patches.set_batch_replicas(object(), 2)
    monkeypatch.delattr(trl.trainer.utils, "FusedCausalLMOutput")
    with pytest.raises(trl_patches.UnsupportedTRLVersion, match="trl.trainer.utils has no class FusedCausalLMOutput"):
        trl_patches.fused_output_class()


def test_ring_forward_refuses_what_it_cannot_shard():
    from hf_ring.training.trl.fused_forward import RingFusedForward

    forward = RingFusedForward(lambda **kw: None, fake_cp_state(0, 2))
    ids = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="multimodal"):
        forward(input_ids=ids, labels=ids, fused_lm_head=True, pixel_values=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="fused_lm_head"):
        forward(input_ids=ids, labels=ids)
    left_padded = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        forward(input_ids=ids, labels=ids, attention_mask=left_padded, fused_lm_head=True)


def test_trainers_refuse_what_they_cannot_do_exactly(tmp_path, fresh_process_state):
    from trl import DPOConfig

    from hf_ring import RingAttentionPlugin
    from hf_ring.trl import RingDPOTrainer, RingSFTTrainer

    config = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, use_cpu=True, report_to="none")
    with pytest.raises(NotImplementedError, match="precompute_ref_log_probs"):
        RingDPOTrainer(model=None, args=config, ring_plugin=RingAttentionPlugin(cp_size=2))
    with pytest.raises(ValueError, match="builds its collator"):
        sft_trainer(RingSFTTrainer, "text", False, str(tmp_path / "sft"), data_collator=lambda rows: rows,
                     ring_plugin=RingAttentionPlugin())
    with pytest.raises(ValueError, match="RingSFTTrainer takes no chunked_loss="):
        sft_trainer(RingSFTTrainer, "text", False, str(tmp_path / "sft"), chunked_loss=False,
                    ring_plugin=RingAttentionPlugin())


def test_the_trainers_own_checks_run_at_construction(tmp_path, fresh_process_state):
    """The TRL trainers add refusals by extending ``_check_supported``; RingTrainer calls it
    once, on every rank together (it had stopped calling it, leaving DPO's and SFT's own
    refusals unreached)."""
    from hf_ring import RingAttentionPlugin
    from hf_ring.trl import RingSFTTrainer

    calls = []

    class Checked(RingSFTTrainer):
        def _check_supported(self) -> None:
            super()._check_supported()
            calls.append(type(self).__name__)
            raise NotImplementedError("refused by the subclass's own check")

    with pytest.raises(NotImplementedError, match="refused by the subclass's own check"):
        sft_trainer(Checked, "text", False, str(tmp_path / "sft"), ring_plugin=RingAttentionPlugin())
    assert calls == ["Checked"]
