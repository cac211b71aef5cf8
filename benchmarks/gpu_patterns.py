"""gpu_check.py's sections for the context-parallel patterns and logit softcapping.

- :func:`softcap_blocks`: each backend whose kernels take ``softcap`` (flash-attn 2 on
  CUDA) against the float64 reference with the same cap, forward and backward, causal
  and not, MHA and GQA.
- :func:`patterns_virtual`: the all-gather pattern's virtual run (every rank in turn on one
  device, K/V gathered by in-process copies) against full attention: out, lse, dq (the
  parts a virtual run computes exactly; every pattern's dK/dV and Ulysses / hybrid are
  tested over gloo in tests/test_cp_patterns.py).
- :func:`measure_patterns` / :func:`describe_pattern`: pattern_efficiency.measure for
  gpu_check's budgeted efficiency sweep (bf16, zigzag), and one printed line per row.

Kept apart from gpu_check.py, which calls them with its device and backends.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

import pattern_efficiency as patterns
import ring_efficiency as bench

import hf_ring
from hf_ring.kernels import get_backend
from hf_ring.patterns import AttentionPlan
from hf_ring.patterns.allgather import allgather_attention
from hf_ring.patterns.ring.chunk_varlen import chunk_varlen_runs_here
from hf_ring.patterns.ring.prefix import prefix_runs_here
from hf_ring.distributed.collectives import VirtualCollectives
from hf_ring.sharding import unshard_packed


def softcap_blocks(device: torch.device, names: list[str], dtype: torch.dtype, check: Callable,
                   length: int = 200) -> None:
    """``check(what, errors)`` for every softcap-capable backend of ``names`` on blocks of
    about ``length`` rows (one off the kernels' tiles, one non-causal with q_len != k_len)."""
    ref = get_backend("reference", device, torch.float64)
    tile = (length * 32 // 25) // 8 * 8  # a multiple of 8 near 1.28 * length
    for name in names:
        kernel = get_backend(name, device, dtype)
        if not kernel.softcap:
            continue
        for (hq, hk), causal, (sq, sk) in [((8, 8), True, (length, length)), ((8, 2), True, (tile, tile)),
                                           ((8, 2), False, (max(8, length * 9 // 25), tile + 8))]:
            g = torch.Generator(device="cpu").manual_seed(1)
            # Scores of a few units, so that a cap of 5 bends them (a cap far above them tests nothing).
            q, k, v, dout = (3 * torch.randn(2, n, h, 64, generator=g).to(device, dtype)
                             for n, h in ((sq, hq), (sk, hk), (sk, hk), (sq, hq)))
            scale, cap = 1 / 8, 5.0
            q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
            ref_out, ref_lse = ref.forward(q64, k64, v64, causal, scale, softcap=cap)
            out, lse = kernel.forward(q, k, v, causal, scale, softcap=cap)
            grads = kernel.backward(dout, q, k, v, ref_out.to(dtype), ref_lse.float(), causal, scale, softcap=cap)
            ref_grads = ref.backward(do64, q64, k64, v64, ref_out, ref_lse, causal, scale, softcap=cap)
            errors = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
            errors |= {n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)}
            check(dict(kind="softcap block", backend=name, dtype=str(dtype).split(".")[1], heads=f"{hq}/{hk}",
                       causal=causal, q_len=sq, k_len=sk), errors)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def patterns_virtual(device: torch.device, name: str, dtype: torch.dtype, check: Callable,
                     seq_per_rank: int = 200) -> None:
    """The virtual all-gather pattern (zigzag, stripe, and a packed row of mixed documents;
    cp 4, ``seq_per_rank`` tokens each) against full attention (the packed row: each
    document alone). On a varlen kernel with bottom-right causal blocks (flash_attn,
    torch_flash) the packed row runs two varlen calls per rank (``ring/chunk_varlen.py``), so
    this checks that kernel's alignment on the GPU; each row names the path it ran
    (``path``)."""
    cfg = bench.BenchConfig(heads=8, kv_heads=2, head_dim=128, dtype=str(dtype).split(".")[1],
                            device=device.type, backend=name)
    scale = 1 / math.sqrt(128)
    ref = get_backend("reference", device, torch.float64)
    for layout in ("zigzag", "stripe", "packed"):
        pb = bench.make_problem(layout, 4, seq_per_rank, cfg)
        packed = dict(pattern="allgather", local_doc_lens=tuple(n // pb.cp for n in pb.doc_lens)) if pb.doc_lens else {}
        outs, lses, dqs = [], [], []
        for r in range(pb.cp):
            plan = AttentionPlan(None, r, pb.cp, "zigzag" if packed else layout, True, scale, cfg.kernel(),
                                 transport=lambda ch: None, **packed)
            q, k, v = (t.detach().requires_grad_() for t in pb.shards[r][:3])
            out, lse = allgather_attention(q, k, v, plan, VirtualCollectives(r, pb.kv_by_rank))
            out.backward(pb.shards[r][3])
            outs.append(out.detach())
            lses.append(lse)
            dqs.append(q.grad)
        q, k, v, dout = (t.double() for t in (pb.q, pb.k, pb.v, pb.dout))
        pieces = []
        for a, b in zip(pb.cu_seqlens[:-1].tolist(), pb.cu_seqlens[1:].tolist()) if packed else [(0, q.shape[1])]:
            o_d, lse_d = ref.forward(q[:, a:b], k[:, a:b], v[:, a:b], True, scale)
            dq_d = ref.backward(dout[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], o_d, lse_d, True, scale)[0]
            pieces.append((o_d, lse_d, dq_d))
        o, lse, dq = (torch.cat(parts, dim=2 if i == 1 else 1) for i, parts in enumerate(zip(*pieces)))
        if packed:
            join = lambda ts, dim=1: unshard_packed(ts, pb.cu_seqlens, dim=dim)  # noqa: E731
        else:
            join = lambda ts, dim=1: hf_ring.unshard_sequence(ts, dim=dim, layout=layout)  # noqa: E731
        errors = {"out": _rel(join(outs), o), "lse": _rel(join(lses, 2), lse), "dq": _rel(join(dqs), dq)}
        path = ("two varlen calls" if chunk_varlen_runs_here(plan) else "prefix calls" if prefix_runs_here(plan)
                else "ring steps")
        check(dict(kind="allgather pattern", backend=name, dtype=str(dtype).split(".")[1], layout=layout, cp=4,
                   path=path), errors)


def measure_patterns(cp: int, spr: int, cfg: bench.BenchConfig) -> list[dict]:
    """Every pattern's virtual efficiency and bytes (zigzag) at one cp and length."""
    return patterns.measure(cp, spr, ["zigzag"], list(patterns.PATTERNS), cfg, None)


def describe_pattern(r: dict) -> str:
    if "skipped" in r:
        return f"{r['pattern']:10} cp={r['cp']} skipped: {r['skipped']}"
    return (f"{r['pattern']:10} cp={r['cp']} seq/rank={r['seq_per_rank']:6} {r['pass']:17} "
            f"eff={r['efficiency']:.3f} sent/rank={r['bytes_sent_per_rank'] / 2**20:8.1f} MiB")


__all__ = ["describe_pattern", "measure_patterns", "patterns_virtual", "softcap_blocks"]
