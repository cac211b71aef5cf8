"""RingSFTTrainer with TRL's own ``peft_config`` logs what TRL's SFTTrainer + the same config logs (issue 22).

The reference is TRL 1.16's ``SFTTrainer`` given ``peft_config=LoraConfig(...)`` (TRL wraps
the model with ``get_peft_model`` itself, enables input gradients under gradient
checkpointing and gives the model under the adapters its fused LM head), in this process,
SDPA. Against it: ``RingSFTTrainer`` with the same ``peft_config`` at cp 1 (this process)
and at cp 2 (a spawned gloo world of 2, ``ring_flash``, both cases in one world). Float32,
4 AdamW steps of 2 x 2 conversations (assistant-only loss), learning rate 1e-2 so that the
metrics move, evaluated at steps 2 and 4. Two cases:

    gc_lm_head   gradient checkpointing on (SFTConfig's default), LoRA on q_proj / v_proj and
                 ``modules_to_save=["lm_head"]`` (TRL's fused head reads the wrapper's copy)
    tied         gradient checkpointing off, tied input / output embeddings, LoRA on q_proj / v_proj

The loss is TRL's fused LM head (chunked: never the full logits) in every run. Every logged
figure (loss, grad_norm, eval_loss, entropy, mean_token_accuracy, num_tokens, train and
eval) must match within 1e-5 relative (absolute below 1): float32, the runs differ only in
the order of sums (the ring's online softmax against SDPA's one pass, the CP group's
reductions); measured at most 9.5e-7 absolute on values near 5.5. The adapters
saved at cp 2 (``save_model``, every rank taking part) load into a plain model (no
hf_ring) with ``PeftModel.from_pretrained`` and give the logits the cp 1 run's adapters
give, within 1e-5 (4 Adam steps of float32 rounding; measured below 1e-6).
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("trl")

from distributed import free_port, run_world  # noqa: E402
from sft_cases import sft_trainer, tiny_llama  # noqa: E402
from test_trl import _figures, compare  # noqa: E402

TOL = 1e-5
LOGITS_TOL = 1e-5
CASES = {
    "gc_lm_head": {"gradient_checkpointing": True, "modules_to_save": ["lm_head"], "tied": False},
    "tied": {"gradient_checkpointing": False, "modules_to_save": None, "tied": True},
}
EXPECTED = {"loss", "grad_norm", "eval_loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_entropy",
            "eval_mean_token_accuracy", "eval_num_tokens"}


def _run_case(trainer_cls: type, name: str, out_dir: str, attn: str, **kwargs) -> list[dict]:
    """Train, evaluate and save (the adapters) one case; return the log history, without the
    figure only hf_ring logs (``eval_token_loss``, checked finite)."""
    case = CASES[name]
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           modules_to_save=case["modules_to_save"])
    trainer = sft_trainer(
        trainer_cls, "messages", False, out_dir, max_steps=4, attn_implementation=attn,
        tie_word_embeddings=case["tied"], peft_config=lora,
        config_overrides={"gradient_checkpointing": case["gradient_checkpointing"], "learning_rate": 1e-2,
                          "eval_strategy": "steps", "eval_steps": 2},
        **kwargs,
    )
    trainer.train()
    trainer.evaluate()
    trainer.save_model()
    history = [dict(e) for e in trainer.state.log_history]
    for entry in history:
        extra = entry.pop("eval_token_loss", None)
        assert extra is None or torch.isfinite(torch.tensor(extra)), entry
    trainer.accelerator.free_memory()
    return history


def _reset(partial: bool) -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=partial)


def _rank_main(rank: int, world: int, tmp: str, port: int) -> dict[str, list[dict]]:
    """Both cases at cp 2 in one world; each rank's log history."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import hf_ring
    from hf_ring.trl import RingSFTTrainer

    out = {}
    for name in CASES:
        out[name] = _run_case(RingSFTTrainer, name, os.path.join(tmp, f"cp2_{name}"), "ring_flash",
                              ring_plugin=hf_ring.RingAttentionPlugin(cp_size=2))
        _reset(partial=False)  # the world's process group stays up for the next case
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(run, case): (log history, output folder)} for run in trl, cp1, cp2."""
    from trl import SFTTrainer

    import hf_ring
    from hf_ring.trl import RingSFTTrainer

    tmp = str(tmp_path_factory.mktemp("trl_lora"))
    world = run_world(2, _rank_main, tmp, free_port())
    for name in CASES:  # every rank logs the same figures
        assert _figures({"log_history": world[0][name]}) == _figures({"log_history": world[1][name]}), name
    out = {("cp2", name): (world[0][name], os.path.join(tmp, f"cp2_{name}")) for name in CASES}
    try:
        for name in CASES:
            for run, cls, kwargs in (("trl", SFTTrainer, {}),
                                     ("cp1", RingSFTTrainer, {"ring_plugin": hf_ring.RingAttentionPlugin()})):
                path = os.path.join(tmp, f"{run}_{name}")
                out[(run, name)] = (_run_case(cls, name, path, "sdpa", **kwargs), path)
                _reset(partial=True)
                hf_ring.set_context_parallel_state(None)
    finally:
        _reset(partial=True)
        hf_ring.set_context_parallel_state(None)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("run", ["cp1", "cp2"])
def test_ring_sft_with_peft_config_logs_what_trl_logs(runs, run, name):
    ref, got = runs[("trl", name)][0], runs[(run, name)][0]
    assert sum(1 for e in ref if "loss" in e) == 4 and sum(1 for e in ref if "eval_loss" in e) >= 2
    worst = compare({"log_history": got}, {"log_history": ref}, tol=TOL)
    assert EXPECTED <= set(worst), sorted(EXPECTED - set(worst))
    print(f"\n{run} {name}: max |ring - trl| per figure: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
    if name == "gc_lm_head":  # the trained head makes the metrics move: the comparison is not one of constants
        accuracy = [e["mean_token_accuracy"] for e in ref if "mean_token_accuracy" in e]
        assert accuracy[0] == 0.0 and max(accuracy) > 0.1, accuracy


def _logits(adapter_dir: Optional[str], tied: bool) -> torch.Tensor:
    """Logits ``(1, 64, vocab)`` float32 of the plain (SDPA, no hf_ring) model, with the adapters
    saved in ``adapter_dir`` (None: without adapters), on fixed random tokens."""
    from trl_data import chat_tokenizer

    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer, "sdpa", tied)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.randint(0, len(tokenizer), (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("name", sorted(CASES))
def test_adapters_saved_at_cp2_load_into_the_plain_model(runs, name):
    from safetensors.torch import load_file

    cp1, cp2 = runs[("cp1", name)][1], runs[("cp2", name)][1]
    saved = load_file(os.path.join(cp2, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(load_file(os.path.join(cp1, "adapter_model.safetensors")))
    assert sum("lora_" in k for k in saved) == 8  # A and B of q_proj and v_proj in 2 layers
    assert any("lm_head" in k for k in saved) == (CASES[name]["modules_to_save"] is not None)
    got, ref = _logits(cp2, CASES[name]["tied"]), _logits(cp1, CASES[name]["tied"])
    base = _logits(None, CASES[name]["tied"])
    assert (ref - base).abs().max() > 1e-3  # the adapters changed the model
    err = (got - ref).abs().max().item()
    print(f"\n{name}: adapters cp2 vs cp1, max |logits difference| {err:.1e}")
    assert err <= LOGITS_TOL, err
