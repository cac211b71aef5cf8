"""Data for the long-context example: a byte-level tokenizer and a passkey-retrieval set.

Both are built on the spot (nothing is downloaded), so the example runs anywhere.

Passkey retrieval: a five-digit number is hidden at a random place in long filler text and
asked for at the end. Only the answer tokens are learned (the prompt's labels are -100),
which is the hard case for context parallelism: the answer sits at the very end of the
sequence, so most ranks' shards hold no valid label at all.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import datasets

IGNORE_INDEX = -100

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river flows to the sea.",
    "A bird sings in the tree.",
)


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; then ``<pad>`` 256, ``<s>`` 257, ``</s>`` 258.

    Has the small part of the tokenizer interface the example uses: ``__call__`` /
    ``encode`` / ``decode``, ``pad_token_id``, ``bos_token_id``, ``eos_token_id``,
    ``vocab_size`` and ``len()``.
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        if not skip_special_tokens:
            specials = {self.pad_token_id: "<pad>", self.bos_token_id: "<s>", self.eos_token_id: "</s>"}
            return "".join(specials[i] if i in specials else chr(i) for i in ids)
        return data.decode("utf-8", errors="replace")


class Tokenizer(Protocol):
    bos_token_id: Any
    eos_token_id: Any

    def __call__(self, text: str, add_special_tokens: bool = False) -> Any: ...


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_example(tokenizer: Tokenizer, rng: random.Random, max_tokens: int) -> dict[str, list[int]]:
    """One example of at most ``max_tokens`` tokens: ``input_ids`` and ``labels`` (answer only).

    A target length is drawn between 3/4 of ``max_tokens`` and ``max_tokens`` (so batches need
    padding) and filled with whole filler sentences, so the example may be a sentence shorter.
    """
    key = rng.randint(10000, 99999)
    head = _ids(tokenizer, "There is a pass key hidden in this text. Find it and remember it.\n")
    needle = _ids(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key. ")
    question = _ids(tokenizer, "\nWhat is the pass key? The pass key is")
    answer = _ids(tokenizer, f" {key}.")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    fixed = len(bos) + len(head) + len(needle) + len(question) + len(answer) + len(eos)
    if fixed > max_tokens:
        raise ValueError(f"max_tokens={max_tokens} is too short for a passkey example ({fixed} tokens without filler)")
    target = rng.randint(max(fixed, 3 * max_tokens // 4), max_tokens)
    filler: list[list[int]] = []
    used = fixed
    while True:
        sentence = _ids(tokenizer, " " + rng.choice(FILLER))
        if used + len(sentence) > target:
            break
        filler.append(sentence)
        used += len(sentence)
    cut = rng.randint(0, len(filler))
    body = [t for s in filler[:cut] for t in s] + needle + [t for s in filler[cut:] for t in s]
    prompt = bos + head + body + question
    completion = answer + eos
    return {
        "input_ids": prompt + completion,
        "labels": [IGNORE_INDEX] * len(prompt) + completion,
    }


def passkey_dataset(tokenizer: Tokenizer, num_examples: int, max_tokens: int, seed: int) -> datasets.Dataset:
    """``num_examples`` passkey examples as a ``datasets.Dataset`` (columns input_ids, labels)."""
    rng = random.Random(seed)
    rows = [passkey_example(tokenizer, rng, max_tokens) for _ in range(num_examples)]
    return datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}
    )
