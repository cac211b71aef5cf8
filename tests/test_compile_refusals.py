"""What ``torch.compile`` under CP has not been checked with is refused by name, with what to do.

``TrainingArguments(torch_compile=True)``: ``RingTrainer``'s check
(``trainer_checks._check_compile_under_cp``) on a trainer that names each unchecked
composition in turn, and on the checked ones (DDP, FSDP2 compiled layer by layer; every
pattern; placement by length and auto), which must pass: the refusal is raised alike on every rank (tests/test_errors_every_rank.py
shows two of them there). ``torch.compile(model)`` by hand on a model whose Mamba blocks
run without keyword arguments (a packed row without CP routes them as CP does): dynamo
took a refusal raised in traced code for a graph break and ran the frame uncompiled, so
nothing was refused; it is raised at run time, for the carrier a decoder layer is
(Jamba's) and for the one a base model is (MambaModel). Routed layers called with their
keyword arguments compile, one op each (tests/test_compile_mixers.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from hf_ring.patches.transformers import release_line
from hf_ring.training.trainer_checks import _check_compile_under_cp
from hf_ring.training.vision.collator import RingVisionDataCollator

PREFIX = "TrainingArguments(torch_compile=True) under context parallelism (cp_size=2)"


def _trainer(model: nn.Module = None, collator=None, regional: bool = False, **flags) -> SimpleNamespace:
    args = SimpleNamespace(gradient_checkpointing=flags.pop("gradient_checkpointing", False),
                           ddp_find_unused_parameters=flags.pop("ddp_find_unused_parameters", False))
    plugin = SimpleNamespace(use_regional_compilation=regional)
    return SimpleNamespace(args=args, model=model or nn.Sequential(nn.Linear(4, 4)), data_collator=collator,
                           accelerator=SimpleNamespace(state=SimpleNamespace(dynamo_plugin=plugin)), **flags)


def _state(**over) -> SimpleNamespace:
    return SimpleNamespace(**{"pattern": "ring", "placement": "sharded", "tp_size": 1, "cp_size": 2, **over})


CASES = {  # name: (trainer, state, words the refusal must say)
    "tensor parallelism": (_trainer(), _state(tp_size=2), "tensor parallelism (tp_size=2)"),
    "gradient checkpointing": (_trainer(gradient_checkpointing=True), _state(), "gradient_checkpointing=True"),
    "DDP's unused-parameter search": (_trainer(ddp_find_unused_parameters=None), _state(),
                                      "pass ddp_find_unused_parameters=False"),
    "DeepSpeed": (_trainer(is_deepspeed_enabled=True), _state(), "DeepSpeed"),
    "FSDP2, whole model": (_trainer(is_fsdp_enabled=True), _state(),
                           "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1"),
    "image-text": (_trainer(collator=RingVisionDataCollator.__new__(RingVisionDataCollator)), _state(),
                   "image-text models"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_unchecked_composition_is_refused_by_name(case):
    trainer, state, words = CASES[case]
    with pytest.raises(NotImplementedError) as refused:
        _check_compile_under_cp(trainer, state)
    message = str(refused.value)
    assert message.startswith(PREFIX) and words in message and "set torch_compile=False" in message, message


@pytest.mark.parametrize("trainer", [_trainer(), _trainer(is_fsdp_enabled=True, regional=True)],
                         ids=["DDP", "FSDP2 by layer"])
def test_the_checked_compositions_pass(trainer):
    for pattern in ("ring", "allgather", "ulysses", "hybrid", "auto"):  # tests/test_compile_cp.py
        _check_compile_under_cp(trainer, _state(pattern=pattern))
    for placement in ("by_length", "auto"):
        _check_compile_under_cp(trainer, _state(placement=placement))


NEEDS_ROUTED_MIXERS = pytest.mark.skipif(release_line(__import__("transformers").__version__) != "5",
                                         reason="token mixers are routed on transformers 5.x only")


def _tiny(family: str) -> nn.Module:
    from model_sweep_configs import build_config
    from test_hf_attention import tiny_model

    return tiny_model(build_config(family), "ring_flash").train()


@NEEDS_ROUTED_MIXERS
def test_carried_token_mixers_are_refused_by_the_trainer_and_routed_layers_pass():
    with pytest.raises(NotImplementedError, match="Mamba blocks run without keyword arguments \\(JambaMambaDecoderLayer"):
        _check_compile_under_cp(_trainer(model=_tiny("jamba")), _state())
    _check_compile_under_cp(_trainer(model=_tiny("qwen3_next")), _state())  # tests/test_compile_mixers.py


@NEEDS_ROUTED_MIXERS
@pytest.mark.parametrize("family, layer", [("jamba", "JambaMambaDecoderLayer"), ("mamba", "MambaModel")])
def test_compiling_a_model_with_carried_token_mixers_by_hand_is_refused(family, layer):
    torch._dynamo.reset()
    model = _tiny(family)
    lens = [6, 10, 8]
    cu = torch.tensor([0, 6, 16, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    with pytest.raises(NotImplementedError, match=f"{layer} under torch.compile on packed rows: it runs its Mamba "
                                                  "blocks without keyword arguments.* run this model uncompiled"):
        torch.compile(model, backend="aot_eager")(torch.randint(3, model.config.vocab_size, (1, 24)),
                                                  position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                  max_length_q=10, max_length_k=10)
