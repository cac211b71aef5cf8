"""One training step of a Llama model under context parallelism, measured per process.

Shared by memory_scaling.py and training_speed.py: spawns ``cp_size`` processes (gloo on
CPU, NCCL on CUDA), each holding its zigzag shard of one sequence, runs forward + backward
+ optimizer step with ``attn_implementation="ring_flash"`` for each requested sequence
length (in increasing order), and reports per-process time, time blocked on ring
transfers and peak memory.

The model is the example's default (examples/finetune_llama_long.py: a Llama with hidden
size 128, 2 layers, 8 query and 4 KV heads, a 259-token byte vocabulary), float32.

Peak memory: on CUDA ``max_memory_allocated`` (reset per length). On CPU the peak resident
set (``ru_maxrss``) minus the resident set after imports and process-group start-up,
i.e. the memory the training itself needs (model, optimizer, activations), as a GPU's
allocated-memory figure would count it. ``ru_maxrss`` never decreases, so lengths run in
increasing order: each length's peak is the largest so far.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class StepConfig:
    cp_size: int
    seq_lens: tuple[int, ...]
    steps: int = 3
    warmup: int = 1
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 256
    vocab_size: int = 259
    threads_per_process: int = 1
    device: str = "cpu"
    # Long-context memory options (hf_ring.memory.chunked_loss / offload / tiled_mlp).
    chunked_loss: bool = False
    loss_chunk_tokens: Optional[int] = None
    offload_checkpoints: bool = False
    tiled_mlp: int = 0
    # CPU only: also report the peak of the last step's forward + backward alone
    # (``peak_backward_mb``), the high-water mark being reset before it (Linux clear_refs).
    phase_peaks: bool = False

    def __post_init__(self) -> None:
        if self.phase_peaks and self.device != "cpu":
            raise ValueError("phase_peaks reads the CPU resident set; on CUDA use the allocator's peak")
        for n in self.seq_lens:
            if n % (2 * self.cp_size):
                raise ValueError(f"seq_len {n} must be a multiple of 2 * cp_size = {2 * self.cp_size}")
        if list(self.seq_lens) != sorted(self.seq_lens):
            raise ValueError("seq_lens must be increasing (peak memory is measured as a running maximum)")
        if self.steps < 1:
            raise ValueError("steps must be >= 1")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        kib = next(line for line in f if line.startswith("VmHWM:")).split()[1]
    return int(kib) / 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _worker(rank: int, cfg: StepConfig, init_file: str, out_dir: str) -> None:
    import hf_ring
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(cfg.threads_per_process)
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=cfg.cp_size)
    state = hf_ring.setup_context_parallel(cfg.cp_size)
    baseline_mb = _rss_mb()
    torch.manual_seed(0)
    model_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=max(cfg.seq_lens),
        use_cache=False,
    )
    model = LlamaForCausalLM._from_config(model_cfg, attn_implementation="ring_flash").to(device)
    model.train()
    offload_stats: dict = {}
    if cfg.offload_checkpoints:
        hf_ring.enable_offloaded_checkpointing(model, offload_stats)
    if cfg.tiled_mlp:
        hf_ring.tile_mlps(model, cfg.tiled_mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = []
    for seq_len in cfg.seq_lens:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        results.append(_measure(model, opt, cfg, state, seq_len, device, sync, baseline_mb))
        results[-1]["offloaded_peak_mb"] = offload_stats.pop("peak_bytes", 0) / 2**20
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _measure(model, opt, cfg: StepConfig, state, seq_len: int, device, sync, baseline_mb: float) -> dict:
    import hf_ring
    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
    from hf_ring.training.loss import count_valid_tokens, loss_share, token_loss_sum
    from hf_ring.distributed.comm import CommWaitStats

    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # shifted on the full sequence
    pos = torch.arange(seq_len).unsqueeze(0)
    shard = lambda t: hf_ring.shard_sequence(t, cfg.cp_size, state.cp_rank).to(device)
    ids_l, labels_l, pos_l = shard(ids), shard(labels), shard(pos)
    n_valid = int(count_valid_tokens(labels))

    waits = CommWaitStats()

    phases: dict = {}

    def step(stats: Optional[CommWaitStats] = None) -> None:
        # The guard hands the sink down to every ring call of the forward (and its backward).
        inputs = dict(input_ids=ids_l, position_ids=pos_l, hf_ring_comm_stats=stats)
        if cfg.chunked_loss:
            chunking = ChunkedLossConfig(True, cfg.loss_chunk_tokens)
            token_sum, _ = model_token_loss_sum(model, model, inputs, labels_l, chunking)
        else:
            token_sum = token_loss_sum(model(**inputs).logits, labels_l)
        loss_share(token_sum, n_valid).backward()
        if cfg.cp_size > 1:
            # Each rank's loss is its share of the global token mean, so the model's
            # gradient is the sum of the ranks' gradients.
            for p in model.parameters():
                dist.all_reduce(p.grad, group=state.cp_group)
        if cfg.phase_peaks:
            phases["backward"] = _hwm_mb()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(cfg.warmup):
        step()
    times = []
    for _ in range(cfg.steps):
        sync()
        dist.barrier()
        if cfg.phase_peaks:
            _reset_hwm()
        start = time.perf_counter()
        step(waits)
        sync()
        times.append(time.perf_counter() - start)
    peak = _peak_mb(device) - (baseline_mb if device.type == "cpu" else 0.0)
    if cfg.phase_peaks:
        phases = {"peak_backward_mb": phases["backward"] - baseline_mb, "peak_step_mb": _hwm_mb() - baseline_mb}
    return {
        **phases,
        "seq_len": seq_len,
        "step_seconds": sorted(times)[len(times) // 2],
        "comm_wait_seconds": waits.seconds / cfg.steps,
        "peak_mb": peak,
        "runtime_baseline_mb": baseline_mb if device.type == "cpu" else 0.0,
    }


def run_step(cfg: StepConfig) -> list[dict]:
    """Run ``cfg`` in fresh processes. Returns one entry per sequence length, with the
    slowest rank's step time and wait, and the largest per-process peak."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(cfg, os.path.join(tmp, "rdzv"), tmp), nprocs=cfg.cp_size, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(cfg.cp_size)]
    merged = []
    for i, seq_len in enumerate(cfg.seq_lens):
        per_rank = [r[i] for r in ranks]
        slowest = max(per_rank, key=lambda r: r["step_seconds"])
        merged.append({
            "cp_size": cfg.cp_size, "seq_len": seq_len,
            "step_seconds": slowest["step_seconds"],
            "comm_wait_seconds": slowest["comm_wait_seconds"],
            "peak_mb_per_process": max(r["peak_mb"] for r in per_rank),
            "runtime_baseline_mb": max(r["runtime_baseline_mb"] for r in per_rank),
            "offloaded_peak_mb": max(r.get("offloaded_peak_mb", 0.0) for r in per_rank),
            **{k: max(r[k] for r in per_rank) for k in ("peak_backward_mb", "peak_step_mb") if k in per_rank[0]},
        })
    return merged
