"""gpu_check.py's kernel sections: correctness of each block backend against the float64
reference (one block, and the whole virtual ring), and block-kernel throughput.

Every function takes the device and the backend names, so ``gpu_check.py --dry-run-cpu``
runs the same code on the CPU through the stand-ins of tests/cuda_standins.py.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

import gpu_patterns
import ring_efficiency as bench
from gpu_check_budget import BudgetSpent, Deadline
from hf_ring.kernels import get_backend, registry
from hf_ring.patterns.ring.schedule import step_blocks
from hf_ring.patterns.ring.window import window_blocks
from hf_ring.sharding.layouts import shard_indices

# Relative error bounds by input dtype. The kernels round P (and dP) to the input dtype
# before the second matmul, so out and gradients carry a few units of that dtype's
# rounding (bf16 2^-8, fp16 2^-11); lse is accumulated in float32 throughout.
TOL = {
    torch.bfloat16: {"out": 2e-2, "lse": 1e-3, "grad": 5e-2},
    torch.float16: {"out": 5e-3, "lse": 1e-3, "grad": 1e-2},
    torch.float32: {"out": 1e-3, "lse": 1e-4, "grad": 2e-3},
}
# (q heads, kv heads), head_dim, causal: MHA, GQA, MQA; the first is each backend's core case.
BLOCK_CASES = [((8, 2), 128, True), ((8, 8), 128, True), ((8, 2), 64, True), ((8, 2), 128, False),
               ((8, 1), 64, False)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[1]


def _record(rows: list[dict], what: dict, errors: dict[str, float], tol: dict) -> None:
    ok = all(errors[k] <= tol["grad" if k.startswith("d") else k] for k in errors)
    rows.append({**what, **{f"err_{k}": v for k, v in errors.items()}, "pass": ok})
    errs = " ".join(f"{k}={v:.2e}" for k, v in errors.items())
    print(f"  {'ok  ' if ok else 'BAD '} {' '.join(f'{k}={v}' for k, v in what.items())} {errs}", flush=True)


def check_block(device: torch.device, name: str, dtype: torch.dtype, hq: int, hk: int, d: int, causal: bool,
                sq: int, sk: int, rows: list[dict]) -> None:
    """One block, forward and backward (given the final out and lse, as the ring calls
    it), against the float64 reference on the same rounded inputs."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(2, n, h, d, generator=g).to(device, dtype)
                     for n, h in ((sq, hq), (sk, hk), (sk, hk), (sq, hq)))
    scale = 1 / math.sqrt(d)
    kernel, ref = get_backend(name, device, dtype), get_backend("reference", device, torch.float64)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = ref.forward(q64, k64, v64, causal, scale)
    out, lse = kernel.forward(q, k, v, causal, scale)
    grads = kernel.backward(dout, q, k, v, ref_out.to(dtype), ref_lse.float(), causal, scale)
    ref_grads = ref.backward(do64, q64, k64, v64, ref_out, ref_lse, causal, scale)
    errors = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
    errors |= {n: rel_err(gr, rg) for n, gr, rg in zip(("dq", "dk", "dv"), grads, ref_grads)}
    what = dict(kind="block", backend=name, dtype=_dtype_name(dtype), heads=f"{hq}/{hk}", head_dim=d,
                causal=causal, q_len=sq, k_len=sk)
    _record(rows, what, errors, TOL[dtype])


def check_ring(device: torch.device, name: str, dtype: torch.dtype, layout: str, cp: int, seq_per_rank: int,
               rows: list[dict]) -> None:
    """The virtual ring (ring_efficiency.py) on this backend against full attention: out, lse, dq."""
    cfg = bench.BenchConfig(heads=8, kv_heads=2, head_dim=128, dtype=_dtype_name(dtype), device=device.type,
                            backend=name)
    pb = bench.make_problem(layout, cp, seq_per_rank, cfg)
    scale = 1 / math.sqrt(128)
    got = bench.virtual_ring(pb, cfg.kernel(), scale)
    ref = get_backend("reference", device, torch.float64)
    q, k, v, dout = (t.double() for t in (pb.q, pb.k, pb.v, pb.dout))
    parts: dict[str, list] = {"out": [], "lse": [], "dq": []}
    for c in bench.full_calls(pb):  # one causal block per document (the whole row if dense)
        o, lse = ref.forward(q[:, c], k[:, c], v[:, c], True, scale)
        dq = ref.backward(dout[:, c], q[:, c], k[:, c], v[:, c], o, lse, True, scale)[0]
        for n, t in zip(parts, (o, lse, dq)):
            parts[n].append(t)
    want = {n: torch.cat(ts, 2 if n == "lse" else 1) for n, ts in parts.items()}
    errors = {n: rel_err(got[n], want[n]) for n in got}
    what = dict(kind="ring", backend=name, dtype=_dtype_name(dtype), layout=layout, cp=cp, seq=pb.q.shape[1])
    _record(rows, what, errors, TOL[dtype])


def window_mask(local: int) -> torch.Tensor:
    """A window-edge mask of two bands: at cp=3 rank 1 holds zigzag chunks 1 and 4, and its
    step-1 block (keys: chunk 0) under a window of 1.5 * local + 3 tokens sees all of
    chunk 0 from chunk 1 and a corner of it from chunk 4, the masked kernels' hardest case."""
    seq, window = 3 * local, 3 * (local // 2) + 3
    q_pos, k_pos = shard_indices(seq, 3, 1, "zigzag"), shard_indices(seq, 3, 0, "zigzag")
    blocks = window_blocks(step_blocks("zigzag", True, local, 1, 0), q_pos, k_pos, window)
    return next(b.mask for b in blocks if b.mask is not None)


def check_window(device: torch.device, name: str, dtype: torch.dtype, local: int, rows: list[dict]) -> None:
    """The masked kernel (sliding windows inside the ring) on a window-edge block against
    the float64 reference's masked kernel."""
    mask = window_mask(local).to(device)
    sq, sk = mask.shape
    g = torch.Generator(device="cpu").manual_seed(1)
    q, dout = (torch.randn(2, sq, 8, 128, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(2, sk, 2, 128, generator=g).to(device, dtype) for _ in range(2))
    kernel, ref = get_backend(name, device, dtype), get_backend("reference", device, torch.float64)
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = ref.masked_forward(q64, k64, v64, mask, 128 ** -0.5)
    out, lse = kernel.masked_forward(q, k, v, mask, 128 ** -0.5)
    grads = kernel.masked_backward(dout, q, k, v, ref_out.to(dtype), ref_lse.float(), mask, 128 ** -0.5)
    ref_grads = ref.masked_backward(do64, q64, k64, v64, ref_out, ref_lse, mask, 128 ** -0.5)
    seen = mask.any(dim=1)
    errors = {"out": rel_err(out, ref_out), "lse": rel_err(lse[..., seen], ref_lse[..., seen])}
    errors |= {n: rel_err(gr, rg) for n, gr, rg in zip(("dq", "dk", "dv"), grads, ref_grads)}
    unseen_ok = bool((lse[..., ~seen] == float("-inf")).all())
    what = dict(kind="window", backend=name, dtype=_dtype_name(dtype), q_len=sq, k_len=sk, empty_rows_ok=unseen_ok)
    _record(rows, what, errors if unseen_ok else {**errors, "lse": float("inf")}, TOL[dtype])


def check_softcap(device: torch.device, name: str, dtype: torch.dtype, length: int, rows: list[dict]) -> None:
    """Logit softcapping on the backend's blocks (about ``length`` rows) against the float64
    reference with the same cap."""
    gpu_patterns.softcap_blocks(device, [name], dtype, lambda what, errors: _record(rows, what, errors, TOL[dtype]),
                                length)


def check_allgather(device: torch.device, name: str, dtype: torch.dtype, seq_per_rank: int,
                    rows: list[dict]) -> None:
    """The virtual all-gather pattern on this backend against full attention (out, lse, dq)."""
    gpu_patterns.patterns_virtual(device, name, dtype, lambda what, errors: _record(rows, what, errors, TOL[dtype]),
                                  seq_per_rank)


def correctness_cases(device: torch.device, names: list[str], dtypes: dict[str, list[torch.dtype]],
                      block_len: int, ring_len: int,
                      block_cases: list = BLOCK_CASES) -> list[tuple[int, str, Callable[[list], None]]]:
    """(priority, backend, check) for every check, cheapest-first per backend: each
    backend's core bf16 block case, then its ring, then the rest, so that a time budget
    cut short still leaves every backend checked."""
    cases = []
    short = max(8, block_len * 17 // 25)  # q_len != k_len, neither a multiple of the kernels' tiles
    def case(priority: int, name: str, check: Callable, *args) -> None:
        cases.append((priority, name, lambda rows: check(device, name, *args, rows)))

    for name in names:
        for dtype in dtypes[name]:
            primary = dtype == dtypes[name][0]
            for i, ((hq, hk), d, causal) in enumerate(block_cases):
                for sq, sk in ([(block_len, block_len)] if causal else [(block_len, short), (short // 2, block_len)]):
                    case(0 if primary and i == 0 else 2, name, check_block, dtype, hq, hk, d, causal, sq, sk)
            if primary and registry._REGISTERED[name].backend.masked:
                case(1, name, check_window, dtype, ring_len)
            if primary:
                for layout, cp in (("zigzag", 4), ("packed", 2)):
                    case(1, name, check_ring, dtype, layout, cp, ring_len)
                if registry._REGISTERED[name].backend.softcap:
                    case(2, name, check_softcap, dtype, block_len)
                case(2, name, check_allgather, dtype, ring_len)
    return sorted(cases, key=lambda c: c[0])  # stable: backends keep their order within a priority


def correctness(cases: list, deadline: Deadline, result: dict) -> None:
    """Run ``cases`` (from :func:`correctness_cases`) into ``result`` (``checks``: one row per
    check; ``skipped``: cases per backend not run once ``deadline`` was spent; ``interrupted``:
    the backend whose case the deadline cut short, if one was)."""
    rows: list[dict] = result.setdefault("checks", [])
    skipped: dict[str, int] = result.setdefault("skipped", {})
    for _, name, fn in cases:
        if deadline.spent():
            skipped[name] = skipped.get(name, 0) + 1
            continue
        try:
            fn(rows)
        except BudgetSpent:  # the section's timer: the case in progress is not a kernel failure
            skipped[name] = skipped.get(name, 0) + 1
            result["interrupted"] = name
            print(f"  correctness: time budget ran out during a {name} case", flush=True)
        except Exception as e:  # one unsupported case must not stop the others
            rows.append({"kind": "error", "backend": name, "pass": False, "error": f"{type(e).__name__}: {e}"})
            print(f"  BAD  backend={name} raised {type(e).__name__}: {e}", flush=True)
    if skipped:
        print(f"correctness: time budget spent, checks not run: {skipped}", flush=True)


def device_time(device: torch.device, fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def throughput(device: torch.device, names: list[str], seq: int, heads: int, kv_heads: int, deadline: Deadline,
               result: dict, repeats: int = 5) -> None:
    """Forward and backward TFLOP/s of one bf16 block per backend, causal (a ring's
    diagonal step) and not (every other step), head_dim 128, into ``result["rows"]``, and
    the order they rank in (``result["measured_order"]``), until ``deadline``."""
    rows, d = result.setdefault("rows", []), 128
    result["measured_order"] = []
    g = torch.Generator(device="cpu").manual_seed(0)
    q, dout = (torch.randn(1, seq, heads, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, seq, kv_heads, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
    for name in names:
        for causal in (False, True):
            if deadline.spent():
                print(f"throughput: time budget spent before {name} causal={causal}", flush=True)
                continue
            kernel = get_backend(name, device, torch.bfloat16)
            out, lse = kernel.forward(q, k, v, causal, d ** -0.5)
            t_fwd = device_time(device, lambda: kernel.forward(q, k, v, causal, d ** -0.5), repeats)
            t_bwd = device_time(device, lambda: kernel.backward(dout, q, k, v, out, lse, causal, d ** -0.5), repeats)
            flops = 4 * seq * seq * heads * d * (0.5 if causal else 1.0)  # two matmuls forward, five backward
            rows.append({"backend": name, "causal": causal, "seq": seq, "heads": f"{heads}/{kv_heads}", "head_dim": d,
                         "t_fwd_s": t_fwd, "t_bwd_s": t_bwd, "tflops_fwd": flops / t_fwd / 1e12,
                         "tflops_bwd": 2.5 * flops / t_bwd / 1e12})
            r = rows[-1]
            print(f"  {name:16} causal={causal!s:5} seq={seq} fwd {t_fwd * 1e3:8.2f} ms {r['tflops_fwd']:7.1f} TFLOP/s"
                  f"  bwd {t_bwd * 1e3:8.2f} ms {r['tflops_bwd']:7.1f} TFLOP/s", flush=True)
            total: dict[str, float] = {}
            for r in rows:
                total[r["backend"]] = total.get(r["backend"], 0.0) + r["t_fwd_s"] + r["t_bwd_s"]
            complete = [n for n in total if sum(r["backend"] == n for r in rows) == 2]
            result["measured_order"] = sorted(complete, key=total.get)
