"""The HF Trainer trains hybrid models under context parallelism exactly as without it: token
mixers other than attention (Qwen3.5's gated delta nets, LFM2's short convolutions, Granite
4.0 hybrid's Mamba-2 layers).

Runs examples/finetune_llama_long.py for real, as tests/test_trainer_cp.py does (float32, a
fixed seed, `accelerate launch`, gloo on CPU; 4 examples per optimizer step: batch 2 x
accumulation 2; 8 steps, evaluations at steps 4 and 8), on a tiny config of each family
(tests/model_sweep_configs.py: one mixer layer and one attention layer, hidden size 64) given
with --config_name. Every logged training loss, gradient norm and eval loss must agree within
1e-4 relative:

    cp2          2 processes, cp 2, padded rows                       against cp1
    packed_cp2   2 processes, cp 2, --packing, --offload_checkpoints  against cp1
    fsdp_cp2     qwen3_5_text: FSDP2 over the CP group                against cp1
    SFT          lfm2: examples/sft_long.py, TRL-packed plain text (every token learned), cp 2
                 with --gradient_checkpointing against cp 1 (ring_flash), every figure TRL logs

References. cp1 is one process with "sdpa": the stock transformers model, to which hf_ring
routes nothing, each row one document padded at its end (the model is causal: no document
token sees the padding). It is also the packed runs' reference: each of their steps packs the
same 4 documents, and the loss is the same token mean, so the same loss and gradient. A packed
run at cp 1 would need more to be a reference: only a model built with "ring_flash" keeps the
documents of a row apart in the convolutions and recurrences too (hf_ring runs each mixer once
per document); built with "sdpa" (the example's default at cp 1), a packed Qwen3.5 is refused
by transformers and a packed LFM2 silently mixes each document's first tokens with the
previous document's last (RingTrainer now refuses such a model with packed rows:
test_packing_a_model_with_unrouted_mixers_is_refused). test_packed_reference_keeps_documents_apart checks in-process that
ring_flash's logits on a packed row of the example's documents are each document's own (sdpa
on the document alone) and that sdpa's are not; the SFT case's cp 1 reference (TRL packing)
runs ring_flash for that reason.

Tolerance. float32 on CPU; cp 2 and packing add the same terms in another order (measured:
at most ~3e-6 of the value over the 8 steps); 1e-4 leaves room for that. To make the mixers
matter to the figures, the configs' weights are drawn with standard deviation 0.1, not their
default 0.02, at which removing LFM2's convolutions altogether moves the loss by 5e-6 (no
parity at 1e-4 would see a mixer error). At 0.1, a mixer whose state is cut at the 4 zigzag
chunks of cp 2 moves the first step's gradient norm by ~4e-3 (Qwen3.5) and ~5e-4 (LFM2), which
test_the_logged_figures_see_the_mixers holds above 3x the tolerance. The learning rate is
3e-4: at 1e-3 these weights train chaotically and float32 rounding grows past 1e-4 by step 8.
Token-by-token exactness at every shard and document boundary is the ops' tests'
(test_cp_conv1d.py, test_cp_delta_rule.py) and test_hf_hybrid.py's.

finetune_llama_long.py has no --gradient_checkpointing (its --offload_checkpoints checkpoints
every decoder layer: packed_cp2); sft_long.py's is used in the SFT case. FSDP2: transformers
5.24's Qwen3_5ForCausalLM lists Qwen3_5VisionBlock, a block it does not have, in
``_no_split_modules``, which accelerate's transformer-based wrap policy refuses; RingTrainer
drops absent classes from the list, so the run names no layer class to wrap.

More families: add them to FAMILIES (and their mixing functions to MIXING).
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

from hf_ring.patches.transformers import release_line
from model_sweep_configs import build_config
from closeness import rel_err
from test_trainer_cp import (  # noqa: F401  (fresh_process_state: a fixture)
    COMMON, EXAMPLE, REL_TOL, STEPS, _assert_same, _eval_losses, _grad_norms, _launch, _losses, fresh_process_state,
)
from test_trainer_fsdp import _accelerate_fsdp, _run as _run_command, _state

pytestmark = pytest.mark.skipif(
    release_line(transformers.__version__) != "5",
    reason="hf_ring routes the token mixers of hybrid models on transformers 5.x only",
)

# family -> (its mixer layer type, its attention layer type) in config.layer_types
FAMILIES = {
    "qwen3_5_text": ("linear_attention", "full_attention"),
    "lfm2": ("conv", "full_attention"),
    "granitemoehybrid": ("linear_attention", "full_attention"),  # Granite 4.0 hybrid: Mamba-2
}
# The modeling modules' mixing functions: the arguments that run along the sequence, and their dim.
MIXING = {
    "causal_conv1d_fn": (("hidden_states",), -1),
    "torch_chunk_gated_delta_rule": (("query", "key", "value", "g", "beta"), 1),
    "mamba2_chunk_scan": (("hidden_states", "dt", "B", "C"), 1),
}
FSDP_FAMILY = "qwen3_5_text"
SFT_FAMILY = "lfm2"
INIT_STD = 0.1  # see the module docstring
SEQ, SEED = 256, 3  # the example's --seq_len and --seed (test_trainer_cp.COMMON)
HYBRID = ["--per_device_train_batch_size", "2", "--learning_rate", "3e-4", "--num_train_examples", "32",
          "--num_eval_examples", "4"]

sys.path.insert(0, os.path.dirname(EXAMPLE))
from long_context_data import ByteTokenizer, passkey_dataset  # noqa: E402


def _config(family: str):
    config = build_config(family)
    assert set(config.layer_types) == set(FAMILIES[family]), config.layer_types
    config.initializer_range = INIT_STD
    return config


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """Each family's config, saved for --config_name."""
    dirs = {}
    for family in FAMILIES:
        dirs[family] = str(tmp_path_factory.mktemp(f"{family}_config"))
        _config(family).save_pretrained(dirs[family])
    return dirs


def _finetune(nproc: int, *args: str):
    return lambda config_dir, out: _launch(nproc, out, [*HYBRID, "--config_name", config_dir, *args])


def _fsdp(config_dir: str, out: str) -> dict:
    script = [EXAMPLE, "--output_dir", out, *COMMON, *HYBRID, "--config_name", config_dir, "--cp_size", "2"]
    log = _run_command(_accelerate_fsdp(2) + script)
    assert "[hf_ring] gradients: fsdp2 mesh (2,) over 2 processes" in log, log[-3000:]
    return _state(out)


def _sft(cp_size: int, *args: str):
    def run(config_dir, out):
        from test_trl import _launch as launch_trl

        return launch_trl("sft_long.py", cp_size, out, [*HYBRID, "--config_name", config_dir, "--dataset_format",
                                                         "text", "--packing", *args])
    return run


RUNS = {
    "cp1": _finetune(1),
    "cp2": _finetune(2, "--cp_size", "2"),
    "packed_cp2": _finetune(2, "--packing", "--cp_size", "2", "--offload_checkpoints"),
    "fsdp_cp2": _fsdp,
    "sft_cp1": _sft(1, "--attn_implementation", "ring_flash"),
    "sft_cp2": _sft(2, "--gradient_checkpointing"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, config_dirs):
    """Launch each (family, configuration) once, on demand; keep its trainer_state.json."""
    cache: dict[tuple[str, str], dict] = {}

    def get(family: str, name: str) -> dict:
        if (family, name) not in cache:
            out = str(tmp_path_factory.mktemp(f"{family}_{name}"))
            cache[(family, name)] = RUNS[name](config_dirs[family], out)
        return cache[(family, name)]

    return get


def _worst(got: dict[int, float], ref: dict[int, float]) -> float:
    return max(abs(got[s] - v) / abs(v) for s, v in ref.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_trains_and_is_finite(runs, family):
    losses = _losses(runs(family, "cp1"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1]  # it learns


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name, reference", [("cp2", "cp1"), ("packed_cp2", "cp1")])
def test_same_figures_as_the_reference(runs, family, name, reference):
    ref, got = runs(family, reference), runs(family, name)
    worst = {}
    for what, read in (("training loss", _losses), ("gradient norm", _grad_norms), ("eval loss", _eval_losses)):
        _assert_same(read(got), read(ref), f"{family} {name} {what}")
        worst[what] = _worst(read(got), read(ref))
    assert got["global_step"] == STEPS and sorted(_eval_losses(ref)) == [4, STEPS]
    print(f"\n{family} {name} vs {reference}: max relative difference "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_fsdp2_same_figures_as_one_process(runs):
    ref, got = runs(FSDP_FAMILY, "cp1"), runs(FSDP_FAMILY, "fsdp_cp2")
    for what, read in (("training loss", _losses), ("gradient norm", _grad_norms), ("eval loss", _eval_losses)):
        _assert_same(read(got), read(ref), f"{FSDP_FAMILY} fsdp_cp2 {what}")
    print(f"\n{FSDP_FAMILY} fsdp_cp2 vs cp1: max relative difference "
          f"{max(_worst(r(got), r(ref)) for r in (_losses, _grad_norms, _eval_losses)):.1e}")


def test_ring_sft_trains_a_hybrid_as_one_process(runs):
    from test_trl import compare

    worst = compare(runs(SFT_FAMILY, "sft_cp2"), runs(SFT_FAMILY, "sft_cp1"))
    assert {"loss", "grad_norm", "eval_loss", "mean_token_accuracy"} <= set(worst)
    print(f"\n{SFT_FAMILY} SFT cp2 vs cp1: max |difference| "
          + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))


# ---- in-process: the references are right and the figures can see a mixer error ----


def _model(config, attn_implementation: str, state_dict=None):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation=attn_implementation)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.float()


def _tokenized(family: str):
    tokenizer = ByteTokenizer()
    config = _config(family)
    config.vocab_size = len(tokenizer)
    return config, tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_reference_keeps_documents_apart(family):
    """ring_flash on a packed row (the example's collator at cp 1) gives each document's own
    logits: those of the stock sdpa model run on that document alone; sdpa on the packed row
    does not (it mixes the documents) or refuses."""
    from hf_ring import RingDataCollator
    from hf_ring.hf.mixers import route_mixers

    config, tokenizer = _tokenized(family)
    ring = _model(config, "ring_flash").eval()
    sdpa = _model(config, "sdpa", ring.state_dict()).eval()
    assert len(route_mixers(ring)) == config.layer_types.count(FAMILIES[family][0])
    batch = RingDataCollator(tokenizer.pad_token_id, packing=True)(passkey_dataset(tokenizer, 2, SEQ, seed=SEED))
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    cu = batch["cu_seq_lens_q"].tolist()
    assert len(cu) == 3
    with torch.no_grad():
        alone = torch.cat([sdpa(batch["input_ids"][:, a:b]).logits for a, b in zip(cu, cu[1:])], dim=1)
        apart = rel_err(ring(**inputs).logits, alone)
        assert apart <= 1e-6, apart
        try:
            mixed = sdpa(**inputs).logits
        except ValueError as e:
            assert "packed" in str(e), e
        else:
            print(f"\n{family}: sdpa on the packed row is off by {rel_err(mixed, alone):.1e}, ring_flash by {apart:.1e}")
            assert rel_err(mixed, alone) > 1e-3


def _in_quarters(original, along: tuple[str, ...], dim: int, calls: list):
    """``original`` run on each quarter of the sequence from a zero state (what a CP op that
    passes no state between the 4 zigzag chunks of cp 2 would compute). On transformers 5.25
    ``original`` is a ``kernels`` ``Func`` module taking ``(*args, **kwargs)``: the arguments
    are named by the function it calls. Once a ring_flash model of the family was built in
    this process, ``original`` is hf_ring's router around that name: read through it."""
    from hf_ring.patches.transformers.mixers import _function_of, _unwrapped

    function = _function_of(_unwrapped(original)) or original
    signature = inspect.signature(function)

    def cut(*args, **kwargs):
        calls.append(function.__name__)
        length = signature.bind(*args, **kwargs).arguments[along[0]].shape[dim]
        bounds = [length * i // 4 for i in range(5)]
        outs = []
        for start, end in zip(bounds, bounds[1:]):
            part = signature.bind(*args, **kwargs)
            for name in along:
                part.arguments[name] = part.arguments[name].narrow(dim, start, end - start)
            out = original(*part.args, **part.kwargs)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return (torch.cat(outs, dim), None) if isinstance(out, tuple) else torch.cat(outs, dim)

    return cut


def _first_step(model, docs) -> tuple[float, float]:
    """The token-mean loss of ``docs`` (one row each) and the norm of its gradient."""
    model.zero_grad()
    total, count = 0.0, 0
    for row in docs:
        ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
        logits = model(ids).logits[0, :-1]
        total = total + F.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum")
        count += int((labels[0, 1:] != -100).sum())
    (total / count).backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    return float(total.detach() / count), float(norm)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_logged_figures_see_the_mixers(family, monkeypatch):
    """At these weights a mixer error moves the first step's gradient norm well past the
    tolerance (else the parities above could not fail)."""
    config, tokenizer = _tokenized(family)
    model = _model(config, "sdpa")
    docs = passkey_dataset(tokenizer, 4, SEQ, seed=SEED)
    right = _first_step(model, docs)
    module = sys.modules[type(model).__module__]
    calls: list[str] = []
    for name, (along, dim) in MIXING.items():
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _in_quarters(getattr(module, name), along, dim, calls))
    wrong = _first_step(model, docs)
    assert calls, f"no mixing function of {module.__name__} ran"
    moved = abs(wrong[1] - right[1]) / right[1]
    print(f"\n{family}: mixers cut at the chunks move the first gradient norm by {moved:.1e}")
    assert moved > 3 * REL_TOL, (right, wrong)


def test_packing_a_model_with_unrouted_mixers_is_refused(tmp_path, fresh_process_state):
    """RingTrainer with packed rows and a hybrid built with "sdpa" (whose convolutions would
    reach across documents) refuses, naming the mixer and ring_flash; built with ring_flash,
    or without packing, it is accepted."""
    from transformers import TrainingArguments

    from hf_ring import RingAttentionPlugin, RingTrainer

    config, tokenizer = _tokenized("lfm2")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    plugin = RingAttentionPlugin(cp_size=1)
    packed = plugin.make_collator(tokenizer.pad_token_id, packing=True)
    with pytest.raises(ValueError, match=r"packing=True: .*Lfm2ShortConv.*ring_flash"):
        RingTrainer(model=_model(config, "sdpa"), args=args, ring_plugin=plugin, data_collator=packed)
    RingTrainer(model=_model(config, "sdpa"), args=args, ring_plugin=plugin,
                data_collator=plugin.make_collator(tokenizer.pad_token_id))
    RingTrainer(model=_model(config, "ring_flash"), args=args, ring_plugin=plugin, data_collator=packed)
