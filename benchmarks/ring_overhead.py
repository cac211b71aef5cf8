"""What sharding a document over the ring costs beyond its work: ``placement="auto"``'s coefficients.

``hf_ring.sharding.placement.PlacementCosts`` models a document of ``n`` tokens sharded over
``cp`` ranks as costing each rank ``work(n) / cp`` plus ``ring_cost(n, cp) = cp *
ring_doc_step + (cp - 1) * n / cp * ring_token`` (a ring step's kernel call, merge and
transfer latency per document per step, and the K/V bytes), in tokens of per-token work.
This measures them: rows of equal documents of ``n`` tokens, as many as fill ``--row``
(a multiple of ``cp`` of them), a whole training step of the example's default model
(``benchmarks/placement.py``'s step: forward + backward + the gradients' all-reduce + AdamW,
gloo, one thread per process) under ``"sharded"`` and under ``"by_length"``, which keeps
every document whole with the ranks' work equal, so the two differ by the ring's overhead
alone. Per row ``(t_sharded - t_by_length) / docs`` is one rank's overhead per document;
least squares over every ``(n, cp)`` gives ``ring_doc_step`` and ``ring_token`` in seconds,
divided by the per-token time ``a`` that ``benchmarks/placement.py --costs-only`` fitted on
the same model (``placement_costs.json``) to give tokens. Wall clock (the transfers are the
point), median of ``--repeats`` interleaved steps; the load is recorded.

    python benchmarks/ring_overhead.py                  # cp 2 and 4, n 64 / 256 / 1024: ~5 min on 2 idle cores
    python benchmarks/ring_overhead.py --tiny           # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from placement import _load, _time_steps  # noqa: E402
from ring_efficiency import BenchConfig  # noqa: E402


def _worker(rank: int, cp: int, lengths: list[int], row: int, cfg: BenchConfig, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import hf_ring

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rdzv", rank=rank, world_size=cp)
    result = {n: _time_steps(rank, cp, [n] * (row // n), cfg, row, dist, F, hf_ring, ("sharded", "by_length"))
              for n in lengths}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def measure(cp: int, lengths: list[int], row: int, cfg: BenchConfig) -> list[dict]:
    import torch.multiprocessing as mp

    for n in lengths:
        if row % (n * cp) or n % (2 * cp):
            raise ValueError(f"--row {row} must hold a multiple of cp = {cp} documents of {n} tokens, each a multiple "
                             f"of 2 x cp")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(cp, lengths, row, cfg, tmp), nprocs=cp, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(cp)]
    rows = []
    for n in lengths:
        t = {pl: max(statistics.median(r[n]["times"][pl]["wall"]) for r in ranks) for pl in ("sharded", "by_length")}
        docs = row // n
        rows.append({"cp": cp, "n": n, "docs": docs, "t_sharded_s": t["sharded"], "t_by_length_s": t["by_length"],
                     "overhead_per_doc_s": (t["sharded"] - t["by_length"]) / docs,
                     "throughput_vs_sharded": t["sharded"] / t["by_length"]})
    return rows


def fit(rows: list[dict], a_s_per_token: float) -> dict:
    """Non-negative least squares of ``overhead_per_doc = cp * step + (cp - 1) / cp * n * token``
    over the rows: where the two-term fit gives a coefficient below 0 (noise: the model has no
    gain from sharding), that term is dropped and the other fitted alone."""
    x = torch.tensor([[r["cp"], (r["cp"] - 1) / r["cp"] * r["n"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([r["overhead_per_doc_s"] for r in rows], dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(x, y).solution.squeeze(1)
    if (coef < 0).any():
        keep = int(coef.argmax())
        coef = torch.zeros(2, dtype=torch.float64)
        coef[keep] = max(0.0, float(torch.linalg.lstsq(x[:, keep:keep + 1], y).solution))
    step_s, token_s = coef.tolist()
    return {"ring_doc_step_s": step_s, "ring_token_s": token_s, "a_s_per_token": a_s_per_token,
            "ring_doc_step": step_s / a_s_per_token, "ring_token": token_s / a_s_per_token,
            "max_abs_residual_s": float((x @ coef.unsqueeze(1) - y).abs().max())}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--row", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--costs", default="benchmarks/results/placement_costs.json",
                   help="benchmarks/placement.py's fit of the per-token time a")
    p.add_argument("--out", default="benchmarks/results/ring_overhead.json")
    p.add_argument("--tiny", action="store_true", help="smoke test: cp 2, a 256-token row, 1 repeat")
    a = p.parse_args(argv)
    if a.tiny:
        a.cp, a.lengths, a.row, a.repeats = [2], [32, 64], 256, 1
    cfg = BenchConfig(repeats=a.repeats, warmup=1)
    with open(a.costs) as f:
        a_s = json.load(f)["fit_model"]["a_s_per_token"]
    load0 = _load()
    rows = []
    for cp in a.cp:
        rows += measure(cp, a.lengths, a.row, cfg)
        print(f"cp {cp}: done", file=sys.stderr)
    result = {"rows": rows, "fit": fit(rows, a_s), "row": a.row, "repeats": a.repeats, "clock": "wall",
              "load_before": load0, "load_after": _load(), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(["python benchmarks/ring_overhead.py", *(argv if argv is not None else sys.argv[1:])])}
    print(f"{'cp':>2} {'n':>5} {'docs':>4} {'sharded s':>9} {'by_length s':>11} {'per doc ms':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['cp']:>2} {r['n']:>5} {r['docs']:>4} {r['t_sharded_s']:9.4f} {r['t_by_length_s']:11.4f} "
              f"{1e3 * r['overhead_per_doc_s']:10.3f} {r['throughput_vs_sharded']:6.2f}")
    ft = result["fit"]
    print(f"ring_doc_step = {ft['ring_doc_step']:.2f} tokens ({1e3 * ft['ring_doc_step_s']:.3f} ms), ring_token = "
          f"{ft['ring_token']:.4f} tokens ({1e6 * ft['ring_token_s']:.3f} us); a = {1e6 * a_s:.2f} us/token")
    if not a.tiny:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
