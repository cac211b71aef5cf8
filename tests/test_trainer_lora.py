"""LoRA with RingTrainer's defaults logs what the stock Trainer + PEFT logs (issue 22).

Runs examples/finetune_llama_long.py with ``--lora_r 4 --lora_dropout 0.1`` (PEFT's LoRA on
q_proj and v_proj, dropout on their inputs as LoRA recipes keep it, every other weight frozen)
in float32 with a fixed seed, 8 AdamW steps of 2 x 2 examples (gradient accumulation 2),
evaluated at steps 4 and 8. Under CP each token gets the dropout mask that the stock run
gives it (issue 36; before, both CP ranks drew one mask for their different tokens):

    1 process, --stock_trainer: transformers.Trainer, the model's own loss, SDPA (the reference)
    1 process, RingTrainer, cp 1
    2 processes, RingTrainer, cp 2: ring_flash, and the chunked LM-head loss (on by default
      under CP: it used to fail on PEFT models, whose head sits two modules down)
    2 processes, RingTrainer, cp 2, --fsdp full_shard (FSDP2 through TrainingArguments, the
      frozen base and the adapter sharded over the CP group; the chunked loss on, inside the
      sharded head's call)
    2 processes, RingTrainer, cp 2, --offload_checkpoints (gradient checkpointing of every
      layer, its saved inputs in host memory: with the base frozen, the adapters' gradients
      must still flow through the recomputed layers)

Every logged training loss, gradient norm and eval loss must match the reference within
1e-5 relative (float32: the runs differ only in the order of sums, the ring's online softmax
against SDPA's one pass and the chunked loss's chunks; measured <= 1e-6, FSDP2 <= 1e-7). The
adapter each cp 2 run saves loads into the plain model with ``PeftModel.from_pretrained``,
and its weights are the reference run's within 1e-4 (8 Adam steps amplify float32 rounding
a little). Under FSDP2 the stock ``save_model`` writes nothing (sharded state dict):
RingTrainer gathers the adapter and writes it (``hf_ring.training.adapters``).
"""

from __future__ import annotations

import os

import pytest
import torch

peft = pytest.importorskip("peft")

from test_trainer_cp import _assert_same, _eval_losses, _grad_norms, _launch, _losses, fresh_process_state  # noqa: E402,F401
from test_trainer_fsdp import TRANSFORMERS_5, needs_transformers_5  # noqa: E402

import tensor_parallel_loading  # noqa: E402

TOL = 1e-5
# Every run pads its rows to a multiple of 4 (cp 2's zigzag): one process's dropout mask of a
# row depends on the batch's padded length, so runs padded otherwise draw other masks.
LORA = ["--lora_r", "4", "--lora_dropout", "0.1", "--pad_to_multiple_of", "4"]
FSDP = pytest.param("fsdp_cp2", marks=needs_transformers_5)
TP_LORA = ["--lora_dropout", "0", "--lora_modules", "q_proj,v_proj,o_proj,down_proj", "--lora_init_seed", "5",
           "--per_device_train_batch_size", "2"]
TP = pytest.param("tp2_cp2", marks=pytest.mark.skipif(not tensor_parallel_loading.AVAILABLE,
                                                      reason="DistributedConfig(tp_size) is transformers 5.x"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, nproc, args in (
        ("stock", 1, ["--cp_size", "1", "--stock_trainer"]),
        ("cp1", 1, ["--cp_size", "1"]),
        ("cp2", 2, ["--cp_size", "2"]),
        ("fsdp_cp2", 2, ["--cp_size", "2", "--fsdp", "full_shard"]),
        ("offload_cp2", 2, ["--cp_size", "2", "--offload_checkpoints"]),
        # Beside tensor parallelism: adapters on column- and row-parallel layers, no dropout
        # (a draw on a head-split input is refused beside TP), against the stock run alike.
        ("stock_tp_modules", 1, ["--cp_size", "1", "--stock_trainer", *TP_LORA]),
        ("tp2_cp2", 4, ["--tp_size", "2", "--cp_size", "2", *TP_LORA]),
    ):
        if name == "fsdp_cp2" and not TRANSFORMERS_5:  # the example's --fsdp needs transformers 5
            continue
        if name.endswith(("tp2_cp2", "tp_modules")) and not tensor_parallel_loading.AVAILABLE:
            continue
        path = str(tmp_path_factory.mktemp(name))
        # Under FSDP2 the chunked loss runs inside the sharded head's call (issue 23).
        expect = (("gradients: fsdp2 mesh (2,) over 2 processes",
                   "[hf_ring] chunked loss on (weights sharded by: fsdp2)") if name == "fsdp_cp2" else ())
        out[name] = (path, _launch(nproc, path, [*LORA, *args], expect=expect))
    return out


@pytest.mark.parametrize("name", ["cp1", "cp2", FSDP, "offload_cp2", TP])
def test_lora_logs_what_the_stock_trainer_logs(runs, name):
    ref, got = runs["stock_tp_modules" if name == "tp2_cp2" else "stock"][1], runs[name][1]
    assert len(_losses(ref)) == 8 and len(_eval_losses(ref)) >= 2
    _assert_same(_losses(got), _losses(ref), f"{name} loss", TOL)
    _assert_same(_grad_norms(got), _grad_norms(ref), f"{name} grad norm", TOL)
    _assert_same(_eval_losses(got), _eval_losses(ref), f"{name} eval loss", TOL)


@pytest.mark.parametrize("name", ["cp2", FSDP, TP])
def test_adapter_saved_at_cp2_loads_into_the_plain_model(runs, name):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = runs[name][0]
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = peft.PeftModel.from_pretrained(LlamaForCausalLM(config), path)
    saved = load_file(os.path.join(path, "adapter_model.safetensors"))
    reference = load_file(os.path.join(runs["stock_tp_modules" if name == "tp2_cp2" else "stock"][0],
                                       "adapter_model.safetensors"))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    # A and B of q_proj and v_proj (and o_proj and down_proj beside TP) in 2 layers
    assert len(saved) == len(loaded) == (16 if name == "tp2_cp2" else 8)
    for name, tensor in saved.items():
        match = [p for n, p in loaded.items() if n.replace(".default", "").endswith(name.split("base_model.model.")[-1])]
        assert len(match) == 1 and torch.equal(match[0].detach(), tensor), name
        err = (tensor - reference[name]).norm() / reference[name].norm()
        assert err <= 1e-4, (name, err.item())


def test_quantised_models_are_recognised_and_left_alone_at_cp1(tmp_path, fresh_process_state):
    """The markers of a bitsandbytes model are read without bitsandbytes (its layers by class
    name, through PEFT's wrapper); at cp 1 RingTrainer takes such a model as the stock Trainer
    does (the refusal under CP, on every rank: tests/test_errors_every_rank.py)."""
    from test_errors_every_rank import mark_as_bnb_4bit
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    import hf_ring
    from hf_ring.training.trainer_checks import quantization_markers

    class Linear8bitLt(torch.nn.Linear):  # bitsandbytes' 8-bit layer, by name
        pass

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    assert quantization_markers(model) is None
    model.model.layers[0].mlp.up_proj = Linear8bitLt(32, 64, bias=False)
    assert quantization_markers(model) == "Linear8bitLt layers"
    mark_as_bnb_4bit(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert quantization_markers(model) == (
        "quantization_method='bitsandbytes', config.quantization_config (quant_method='bitsandbytes'), "
        "is_quantized, is_loaded_in_4bit, hf_quantizer=SimpleNamespace, Linear8bitLt layers"
    )
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    hf_ring.RingTrainer(model=model, args=args, data_collator=hf_ring.RingDataCollator(0))
