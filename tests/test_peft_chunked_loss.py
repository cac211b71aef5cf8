"""The chunked LM-head loss on PEFT models (issue 22), one process, float32.

``RingTrainer`` computes the loss chunk by chunk by default under CP
(``hf_ring.memory.chunked_loss``); a LoRA model (``PeftModelForCausalLM``) holds its head two
modules down, and with ``modules_to_save=["lm_head"]`` behind a wrapper whose forward picks the
active adapter's copy. Against the same model's plain forward (full logits, then the token
loss sum): the loss sum within 1e-6 relative and every trainable parameter's gradient within
1e-5 (float32; the chunked loss adds the same per-token terms in another order, measured
~1e-7). Cases: LoRA on the attention, with the head in ``modules_to_save`` (its trained copy
must be the one used: it gets the gradient), with the adapters disabled (the original head),
DoRA, tied embeddings. Refused by name: a LoRA adapter on the head itself.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum  # noqa: E402
from hf_ring.training.loss import token_loss_sum  # noqa: E402
from closeness import grads, rel_err  # noqa: E402

CHUNKS = ChunkedLossConfig(enabled=True, chunk_tokens=5)


def _model(tie: bool = False, **lora) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=tie)
    base = LlamaForCausalLM(config).float()
    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, peft.LoraConfig(**{**settings, **lora}))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 24), generator=g)
    labels = torch.randint(0, 96, (2, 24), generator=g)
    labels[:, :6] = -100
    return {"input_ids": ids}, labels


def _compare(model):
    kwargs, labels = _batch()
    model.zero_grad(set_to_none=True)
    plain = token_loss_sum(model(**kwargs).logits, labels)
    plain.backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)
    chunked, _ = model_token_loss_sum(model, model, kwargs, labels, CHUNKS)
    chunked.backward()
    got = grads(model)
    assert rel_err(chunked.detach(), plain.detach()) <= 1e-6
    assert set(got) == set(want) and want
    for name in want:
        assert rel_err(got[name], want[name]) <= 1e-5, name
    return got


def test_lora_on_attention():
    _compare(_model())


def test_head_in_modules_to_save_uses_the_trained_copy():
    model = _model(modules_to_save=["lm_head"])
    trained = _compare(model)
    copies = [n for n in trained if "lm_head.modules_to_save" in n]
    assert copies, sorted(trained)  # the copy is trained, through the chunked loss
    with model.disable_adapter():  # the original head, with the adapters off
        kwargs, labels = _batch()
        plain = token_loss_sum(model(**kwargs).logits, labels)
        chunked, _ = model_token_loss_sum(model, model, kwargs, labels, CHUNKS)
    assert rel_err(chunked.detach(), plain.detach()) <= 1e-6


def test_dora_and_tied_embeddings():
    _compare(_model(use_dora=True))
    _compare(_model(tie=True))


def test_lora_on_the_head_is_refused_by_name():
    model = _model(target_modules=["q_proj", "lm_head"])
    kwargs, labels = _batch()
    with pytest.raises(NotImplementedError, match="leave lm_head out of target_modules"):
        model_token_loss_sum(model, model, kwargs, labels, CHUNKS)
