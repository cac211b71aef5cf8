"""Write a long-tail length mix of text documents (JSON lines, a ``text`` column) for
``--train_file`` in examples/finetune_llama_long.py and examples/sft_long.py.

    python examples/make_length_mix.py --out data/mix.jsonl --seq_len 8192 --num_docs 512
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/finetune_llama_long.py \\
        --cp_size 2 --seq_len 8192 --packing --train_file data/mix.jsonl --eval_share 0.05

Real long-context data is long-tailed: most documents short, a few very long. The stated
distribution (seeded, so every run of the same flags writes the same file):

- with probability ``1 - long_share`` (default 0.9) a *short* document, its length drawn
  log-uniformly from ``[min_tokens, seq_len // 8)`` (default ``min_tokens`` 16);
- with probability ``long_share`` (default 0.1) a *long* one, its length drawn uniformly
  from ``[seq_len // 2, seq_len]``: it fills most of a row.

A length is counted in the examples' byte tokens, ``<s>`` and ``</s>`` included (the fine-tune
example's ``ByteTokenizer`` adds them): a document of length ``n`` is ``n - 2`` ASCII bytes of
filler sentences, the last one cut. Another tokenizer (``--model_name_or_path``) counts its
own tokens; the lengths are then only the mix's shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context_data import FILLER  # noqa: E402

SPECIAL_TOKENS = 2  # <s> and </s>, added by the byte tokenizer around every document


def length_mix(num_docs: int, seq_len: int, seed: int, long_share: float = 0.1, min_tokens: int = 16) -> list[int]:
    """``num_docs`` document lengths (tokens, specials included) from the distribution above."""
    short_top = seq_len // 8
    if not min_tokens > SPECIAL_TOKENS or short_top <= min_tokens:
        raise ValueError(f"seq_len {seq_len} // 8 must exceed min_tokens {min_tokens} (> {SPECIAL_TOKENS}): "
                         "raise --seq_len or lower --min_tokens")
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be within [0, 1], got {long_share}")
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_docs):
        if rng.random() < long_share:
            lengths.append(rng.randint(seq_len // 2, seq_len))
        else:  # log-uniform over [min_tokens, short_top): as many of 16-32 tokens as of 256-512
            lengths.append(min(short_top - 1, int(math.exp(rng.uniform(math.log(min_tokens), math.log(short_top))))))
    return lengths


def document(rng: random.Random, tokens: int) -> str:
    """ASCII filler text of ``tokens - 2`` bytes (whole sentences, the last one cut)."""
    size = tokens - SPECIAL_TOKENS
    parts, used = [], 0
    while used < size:
        sentence = rng.choice(FILLER) + " "
        parts.append(sentence)
        used += len(sentence)
    return "".join(parts)[:size]


def write_length_mix(path: str, num_docs: int, seq_len: int, seed: int = 0, long_share: float = 0.1,
                     min_tokens: int = 16) -> list[int]:
    """Write the mix to ``path`` (JSON lines, ``{"text": ...}``); return its lengths in order."""
    lengths = length_mix(num_docs, seq_len, seed, long_share, min_tokens)
    rng = random.Random(seed + 1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for n in lengths:
            f.write(json.dumps({"text": document(rng, n)}) + "\n")
    return lengths


def main(argv: Optional[Sequence[str]] = None) -> list[int]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON lines file to write")
    p.add_argument("--seq_len", type=int, default=8192, help="the row length the mix is drawn for (tokens)")
    p.add_argument("--num_docs", type=int, default=512)
    p.add_argument("--long_share", type=float, default=0.1, help="share of long documents (half a row to a row)")
    p.add_argument("--min_tokens", type=int, default=16, help="shortest short document (tokens)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    lengths = write_length_mix(a.out, a.num_docs, a.seq_len, a.seed, a.long_share, a.min_tokens)
    short = sum(n < a.seq_len // 8 for n in lengths)
    print(f"wrote {len(lengths)} documents to {a.out}: {short} under seq_len/8 ({a.seq_len // 8} tokens), "
          f"{len(lengths) - short} of {a.seq_len // 2}-{a.seq_len}; {sum(lengths)} tokens in all, "
          f"median {sorted(lengths)[len(lengths) // 2]}")
    return lengths


if __name__ == "__main__":
    main()
