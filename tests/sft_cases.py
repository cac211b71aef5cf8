"""Tiny SFT runs on the TRL examples' data, built in one process or on each rank of a spawned world.

Shared by tests/test_trl.py (TRL's SFTTrainer against RingSFTTrainer at cp 1) and
tests/test_trl_lora.py (the same with TRL's ``peft_config``, at cp 1 and cp 2): both must
build the same model from the same seed, the same data and the same SFTConfig, or their
logged figures would differ for reasons that are not the trainer's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)


def tiny_llama(tokenizer: Any, attn_implementation: str = "sdpa", tie_word_embeddings: bool = False) -> Any:
    """A 2-layer Llama (hidden 32, vocabulary of ``tokenizer``), float32, seeded: the same
    weights in every process."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.set_seed(5)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, use_cache=False,
        tie_word_embeddings=tie_word_embeddings,
    ))
    model.set_attn_implementation(attn_implementation)
    return model


def sft_trainer(
    trainer_cls: type,
    fmt: str,
    packing: bool,
    out_dir: str,
    *,
    max_steps: int = 3,
    attn_implementation: str = "sdpa",
    tie_word_embeddings: bool = False,
    config_overrides: dict | None = None,
    **kwargs: Any,
) -> Any:
    """A ``max_steps`` SFT run (batch 2 x accumulation 2) of :func:`tiny_llama` on the examples'
    data and tokenizer; ``config_overrides`` change the SFTConfig, ``kwargs`` go to
    ``trainer_cls`` (``ring_plugin``, ``peft_config``, ...)."""
    from trl import SFTConfig
    from trl_data import chat_tokenizer, sft_dataset

    tokenizer = chat_tokenizer()
    settings = dict(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=4, learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, seed=5, data_seed=5,
        max_length=560 if packing else 280, packing=packing, assistant_only_loss=fmt == "messages",
        dataset_num_proc=None, disable_tqdm=True, save_strategy="no",
    )
    settings.update(config_overrides or {})
    model = tiny_llama(tokenizer, attn_implementation, tie_word_embeddings)
    return trainer_cls(model=model, args=SFTConfig(**settings), train_dataset=sft_dataset(fmt, 24, 216, seed=5),
                       eval_dataset=sft_dataset(fmt, 4, 216, seed=6), processing_class=tokenizer, **kwargs)
