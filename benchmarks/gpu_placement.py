"""gpu_check.py's placement section: issue 50's side by side measured on a GPU.

On one GPU, every rank of a virtual ring run in turn (``placement.measure_virtual``: the
ranks' attention, forward + backward, with the plans the forward builds; transfers are
in-device copies, so this is each rank's compute, on the wall clock, synchronised), under
``placement="sharded"``, ``"by_length"`` and ``"auto"``, on placement.py's four mixes at
Llama-3-8B's attention shape (32 / 8 heads of 128, bf16) and cp 8: the figures
docs/performance.md models for the GPU ("The GPU side, modelled"), measured. Each row's
out and gradients under every placement are checked against one process (``max_rel_err``:
bf16, so about 1e-2). What the GPU adds to the CPU's picture: how a short document's
pieces fill the kernel's tiles, and each block call's launch cost.

Must not import hf_ring's training layers; it runs inside gpu_check's time budget.
"""

from __future__ import annotations

from typing import Any

import torch

from placement import MIXES, measure_virtual, mix_doc_lens
from ring_efficiency import BenchConfig


def placement(device: torch.device, names: list[str], deadline: Any, result: dict, cp: int, row: int,
              heads: int, kv_heads: int, repeats: int) -> None:
    """The side by side on the first backend of ``names`` (the fastest by auto's order), bf16,
    one mix after another until ``deadline`` is spent; rows into ``result["rows"]``, mixes
    not reached into ``result["skipped"]``."""
    if not names:
        result["skipped"] = "no backend runs here"
        return
    cfg = BenchConfig(heads=heads, kv_heads=kv_heads, head_dim=128, dtype="bfloat16", device=device.type,
                      backend=names[0], repeats=repeats, warmup=1)
    rows: list[dict] = result.setdefault("rows", [])
    skipped: list[str] = []
    for mix in MIXES:
        if deadline.spent():
            skipped.append(mix)
            continue
        rows += measure_virtual(mix, mix_doc_lens(mix, row, 2 * cp), cp, cfg)
        for r in rows[-3:]:
            print(f"placement {mix:9} cp {cp} {r['placement']:9} efficiency {r['efficiency']:.3f} "
                  f"(slowest rank {1e3 * r['t_slowest_rank_s']:.2f} ms, work imbalance "
                  f"{100 * r['work_imbalance']:.1f} %, {max(r['bytes_sent_per_layer_ranks']) / 2**20:.1f} MiB sent "
                  f"per layer per rank, max_rel_err {r['max_rel_err']:.1e})", flush=True)
    if skipped:
        result["skipped"] = skipped
        print(f"placement: time budget: skipped {skipped}", flush=True)
