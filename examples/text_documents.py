"""Your own documents for the examples' ``--train_file`` / ``--eval_file`` / ``--eval_share``.

A file is read through ``datasets`` by its suffix: ``.jsonl`` / ``.json`` (JSON lines), ``.parquet``,
or ``.txt`` (one document per paragraph: blank lines separate documents). Each document is the
row's ``text`` column. For language modelling (examples/finetune_llama_long.py) each document is
tokenized whole by the example's tokenizer, its own special tokens added (the byte tokenizer:
``<s>`` and ``</s>``; examples/sft_long.py: TRL's end-of-text token appended, as TRL appends
it to a text), and is one example: never cut into blocks nor joined to another (with
``--packing`` the collator packs whole documents, each attending to itself only). A document
longer than ``--seq_len`` tokens is truncated to its first ``seq_len`` (counted and reported).
The loss is on every token of the document.

Why whole documents: a user training on their own length mix wants its lengths as they are
(a long document stays one long sequence, which is what context parallelism is for).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import datasets

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_documents(path: str) -> datasets.Dataset:
    """The ``text`` column of the file at ``path`` as a ``datasets.Dataset`` (one row a document).

    Raises:
        ValueError: an unknown suffix, no ``text`` column, an empty file, or a document that
            is not a string.
    """
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in BUILDERS:
        raise ValueError(f"{path}: read by suffix, one of {sorted(BUILDERS)} (JSON lines, parquet, or text with "
                         "one document per paragraph); got {suffix!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file")
    extra = {"sample_by": "paragraph"} if BUILDERS[suffix] == "text" else {}
    # keep_in_memory: every rank reads the file itself, without writing a cache of it.
    docs = datasets.load_dataset(BUILDERS[suffix], data_files=path, split="train", keep_in_memory=True, **extra)
    if "text" not in docs.column_names:
        raise ValueError(f"{path}: the documents are read from a 'text' column; it has {docs.column_names}")
    if len(docs) == 0:
        raise ValueError(f"{path}: no documents")
    bad = next((i for i, t in enumerate(docs["text"]) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"{path}: document {bad}'s 'text' is {type(docs['text'][bad]).__name__}, not a string")
    return docs.select_columns(["text"])


def split_documents(docs: datasets.Dataset, share: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, held_out)``: ``share`` of ``docs`` (at least one document) held out for
    evaluation, drawn with ``seed`` (the same split on every rank and in every run)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"--eval_share must be within (0, 1), got {share}")
    held = max(1, round(share * len(docs)))
    if held >= len(docs):
        raise ValueError(f"--eval_share {share} of {len(docs)} documents leaves none to train on")
    parts = docs.train_test_split(test_size=held, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def tokenized_documents(docs: datasets.Dataset, tokenizer: Any, seq_len: int,
                        suffix: str = "") -> tuple[datasets.Dataset, int]:
    """Each document tokenized whole (its tokenizer's special tokens added; ``suffix``, e.g. the
    end-of-text token TRL appends to a text, after it), truncated to its first ``seq_len``
    tokens: ``(Dataset of input_ids and labels (= input_ids), number truncated)``."""
    ids, truncated = [], 0
    for i, text in enumerate(docs["text"]):
        tokens = list(tokenizer(text + suffix, add_special_tokens=True)["input_ids"])
        if not tokens:
            raise ValueError(f"document {i} has no tokens (an empty text, and a tokenizer that adds none)")
        if len(tokens) > seq_len:
            tokens, truncated = tokens[:seq_len], truncated + 1
        ids.append(tokens)
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": [list(t) for t in ids]}), truncated


def file_sets(train_file: str, eval_file: Optional[str], eval_share: float, seed: int
              ) -> tuple[datasets.Dataset, Optional[datasets.Dataset]]:
    """The documents to train on and to evaluate on (None: no evaluation): ``eval_file``'s,
    or ``eval_share`` of ``train_file``'s held out, or none."""
    train = load_documents(train_file)
    if eval_file is not None:
        return train, load_documents(eval_file)
    if eval_share > 0:
        return split_documents(train, eval_share, seed)
    return train, None
