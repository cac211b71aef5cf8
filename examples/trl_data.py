"""Data for the TRL examples: a real Hugging Face tokenizer with a chat template, and
SFT / preference datasets made from the passkey-retrieval texts of long_context_data.py.

Nothing is downloaded. The tokenizer is byte-level (every byte one token, no merges, as
the fine-tune example's ByteTokenizer, so ``--seq_len`` counts tokens the same way) plus
chat tokens, wrapped in ``PreTrainedTokenizerFast``; its chat template marks the
assistant's turns with ``{% generation %}`` so TRL's ``assistant_only_loss`` can mask the
rest.
"""

from __future__ import annotations

import random

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from long_context_data import IGNORE_INDEX, ByteTokenizer, passkey_dataset

SPECIAL_TOKENS = ("<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FORMATS = ("messages", "prompt_completion", "text")


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (256 byte tokens, then the special tokens) with CHAT_TEMPLATE."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="<|end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_chat_tokenizer(model_name_or_path: str | None, tokenizer_name: str | None = None) -> PreTrainedTokenizerFast:
    """The checkpoint's tokenizer (``tokenizer_name``'s where given; with :data:`CHAT_TEMPLATE`
    if it has no chat template of its own), or :func:`chat_tokenizer` for the embedded default model."""
    if not model_name_or_path:
        if tokenizer_name:
            raise ValueError("--tokenizer_name goes with --model_name_or_path (the default model has its own "
                             "tokenizer)")
        return chat_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or model_name_or_path)
    tokenizer.chat_template = tokenizer.chat_template or CHAT_TEMPLATE
    return tokenizer


def _passkey_texts(num_examples: int, max_tokens: int, seed: int) -> list[tuple[str, str]]:
    """``(prompt, answer)`` texts of passkey examples of at most ``max_tokens`` bytes."""
    byte_tok = ByteTokenizer()
    rows = passkey_dataset(byte_tok, num_examples, max_tokens, seed=seed)
    texts = []
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        prompt = [t for t, lab in zip(ids, labels) if lab == IGNORE_INDEX]
        answer = [lab for lab in labels if lab != IGNORE_INDEX]
        texts.append((byte_tok.decode(prompt), byte_tok.decode(answer)))
    return texts


def sft_dataset(fmt: str, num_examples: int, max_tokens: int, seed: int) -> datasets.Dataset:
    """Passkey examples in one of TRL's SFT formats.

    ``messages``: conversations (user asks, assistant answers; with ``assistant_only_loss``
    only the answer is learned); ``prompt_completion``: plain text, completion-only loss by
    TRL's default; ``text``: language modelling on the whole text.
    """
    texts = _passkey_texts(num_examples, max_tokens, seed)
    if fmt == "messages":
        rows = {"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in texts]}
    elif fmt == "prompt_completion":
        rows = {"prompt": [p for p, _ in texts], "completion": [a for _, a in texts]}
    elif fmt == "text":
        rows = {"text": [p + a for p, a in texts]}
    else:
        raise ValueError(f"unknown dataset format {fmt!r}; use one of {FORMATS}")
    return datasets.Dataset.from_dict(rows)


def preference_dataset(num_examples: int, max_tokens: int, seed: int) -> datasets.Dataset:
    """Conversational preference pairs: the right pass key is chosen, another one rejected."""
    rng = random.Random(seed + 7919)
    prompts, chosen, rejected = [], [], []
    for prompt, answer in _passkey_texts(num_examples, max_tokens, seed):
        key = int(answer.strip(" ."))
        wrong = (key + rng.randint(1, 89998)) % 90000 + 10000
        prompts.append([{"role": "user", "content": prompt}])
        chosen.append([{"role": "assistant", "content": answer}])
        rejected.append([{"role": "assistant", "content": f" {wrong}."}])
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
