"""What drawing a dropout mask as one process draws it costs a CP rank, per call.

Under context parallelism hf_ring makes a random draw on a sequence-sharded tensor on the
full sequence's shape and keeps this rank's tokens (hf_ring/hf/randomness/draws.py), so that
every token gets the mask one process gives it. This prints, for one rank's
``F.dropout(x, p, training=True)`` on ``x`` of ``(1, tokens / cp, hidden)``:

- ``local_s``: the plain local draw (what runs without hf_ring's mode: the wrong mask,
  the same on every rank), ``full_s``: the draw under the mode, each the median of
  ``--repeats`` calls;
- ``local_peak_gib`` / ``full_peak_gib``: how far the process's resident memory rose over
  one call, ``x`` included (Linux's VmHWM, reset before the call), against
  ``activation_gib``, the size of ``x`` itself.

One JSON line per (tokens, hidden, cp, dtype). CPU only; a GPU's kernel differs, the
buffers it makes do not (a tensor of ones and the op's output, each ``cp`` times ``x``).

    python benchmarks/random_draws_cost.py --tokens 131072 --hidden 4096 --cp 2 4 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.nn.functional as F

from hf_ring.hf.randomness.draws import OneProcessDraws
from hf_ring.sharding.layouts import shard_indices

P = 0.1


def _call(tokens: int, hidden: int, cp: int, dtype: torch.dtype, full: bool) -> float:
    """Seconds of one rank-0 dropout call; the input is made before the clock starts."""
    local = tokens // cp
    x = torch.randn(1, local, hidden, dtype=dtype)
    index = shard_indices(tokens, cp, 0, "zigzag")
    draws = OneProcessDraws(1, local, cp, index, (0,) * cp)
    start = time.perf_counter()
    if full:
        with draws:
            y = F.dropout(x, P, True)
    else:
        y = F.dropout(x, P, True)
    seconds = time.perf_counter() - start
    del y
    return seconds


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_growth(tokens: int, hidden: int, cp: int, dtype: torch.dtype, full: bool) -> float:
    """GiB the process's resident memory rose above where it stood before one call (Linux:
    the peak is reset through /proc/self/clear_refs, then read as VmHWM)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    _call(tokens, hidden, cp, dtype, full)
    return (_status_kib("VmHWM") - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[131072])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for tokens in args.tokens:
        for cp in args.cp:
            local = [_call(tokens, args.hidden, cp, dtype, False) for _ in range(args.repeats)]
            full = [_call(tokens, args.hidden, cp, dtype, True) for _ in range(args.repeats)]
            row = {
                "tokens": tokens, "hidden": args.hidden, "cp": cp, "dtype": args.dtype, "threads": args.threads,
                "activation_gib": tokens // cp * args.hidden * dtype.itemsize / 2**30,
                "local_s": statistics.median(local), "full_s": statistics.median(full),
                "local_peak_gib": _peak_growth(tokens, args.hidden, cp, dtype, False),
                "full_peak_gib": _peak_growth(tokens, args.hidden, cp, dtype, True),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
