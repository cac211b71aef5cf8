"""One training step of a Llama (or a sweep family's) model under context parallelism,
measured per process.

Shared by memory_scaling.py, training_speed.py, long_context_memory.py and hybrid_step.py:
spawns ``cp_size`` processes (gloo on CPU, NCCL on CUDA), each holding its zigzag shard
of one sequence, runs forward + backward + optimizer step with
``attn_implementation="ring_flash"`` for each requested sequence length (in increasing
order), and reports per-process time (wall and CPU), time blocked on ring transfers and
peak memory.

The model is the example's default (examples/finetune_llama_long.py: a Llama with hidden
size 128, 2 layers, 8 query and 4 KV heads, a 259-token byte vocabulary), float32; with
``family``, that family's sweep config (tests/model_sweep_configs.py) scaled to the same
sizes (``family_config``: hybrids keep their mix of token-mixer and attention layers).
``account_layers`` adds, per length, the timed steps' split by kind of layer and one
forward's saved-for-backward bytes (layer_accounting.py).

Peak memory: on CUDA ``max_memory_allocated`` (reset per length). On CPU the peak resident
set (``ru_maxrss``) minus the resident set after imports and process-group start-up,
i.e. the memory the training itself needs (model, optimizer, activations), as a GPU's
allocated-memory figure would count it. ``ru_maxrss`` never decreases, so lengths run in
increasing order: each length's peak is the largest so far.
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, Optional

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
    # A hybrid (or any) family of tests/model_sweep_configs.py instead of the Llama: its
    # tiny config scaled up to this config's sizes (family_config).
    family: Optional[str] = None
    # Every timed step also timed by kind of layer (layer_accounting.LayerTimer) and phase
    # (``step_accounts``), and after them one forward whose saved-for-backward bytes are
    # counted (``saved_bytes``), per sequence length.
    account_layers: bool = False
    # cp_size 1 only: what runs the family's token mixers. "transformers": the modeling
    # module's own functions (what runs without hf_ring); "hf_ring": hf_ring's mixer ops in
    # one process, the code each rank runs under CP (hf_ring_one_process_mixers).
    mixer_impl: str = "transformers"

    def __post_init__(self) -> None:
        if self.family is not None:
            family_config(self)  # refuses an unknown family or sizes that do not scale
        if self.mixer_impl not in MIXER_IMPLS:
            raise ValueError(f"mixer_impl must be one of {MIXER_IMPLS}, got {self.mixer_impl!r}")
        if self.mixer_impl != "transformers" and (self.family is None or self.cp_size != 1):
            raise ValueError("mixer_impl='hf_ring' applies to a family's model at cp_size 1 (under CP the "
                             "routed mixers run hf_ring's ops anyway)")
        if self.phase_peaks and self.device != "cpu":
            raise ValueError("phase_peaks reads the CPU resident set; on CUDA use the allocator's peak")
        for n in self.seq_lens:
            if n % (2 * self.cp_size):
                raise ValueError(f"seq_len {n} must be a multiple of 2 * cp_size = {2 * self.cp_size}")
        if list(self.seq_lens) != sorted(self.seq_lens):
            raise ValueError("seq_lens must be increasing (peak memory is measured as a running maximum)")
        if self.steps < 1:
            raise ValueError("steps must be >= 1")


MIXER_IMPLS = ("transformers", "hf_ring")
TINY_HIDDEN = 64  # the sweep's hidden size (tests/model_sweep_configs.py COMMON)
# The token mixers' head sizes (and Mamba's inner width), scaled with the hidden size where
# the tiny config has them; head counts, SSM state sizes and the conv width stay.
MIXER_WIDTHS = ("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "mamba_d_head",
                "mamba_head_dim", "mamba_d_ssm")
CHUNKS = ("chunk_size", "mamba_chunk_size")  # scan chunks: the gated delta rule's 64, not the sweep's 16
PER_LAYER = ("layer_types", "mlp_layer_types", "layers_block_type")


def family_config(cfg: StepConfig):
    """The model config of ``cfg.family``: the sweep's tiny config
    (``model_sweep_configs.build_config``: one layer of every layer type the full-size model
    uses) scaled to ``cfg``'s sizes. Hidden, intermediate, vocabulary, attention heads (head
    size ``hidden / num_heads``) from ``cfg``; the mixers' head sizes (and Mamba's inner
    width) times ``hidden / 64``, their head counts unchanged, so the mixers' widths keep
    their ratios to the hidden size (Qwen3.5: keys hidden / 2, values hidden, as in the
    released models); its per-layer types repeated to ``num_layers`` (``linear_attention,
    full_attention, linear_attention, ...``); scan chunks of 64; no dropout, no cache.

    Raises:
        ValueError: an unknown family, sizes that do not scale (hidden not a multiple of 64
            and of num_heads), or fewer layers than the family has layer types.
    """
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from model_sweep_configs import build_config, family_names

    if cfg.family not in family_names():
        raise ValueError(f"unknown family {cfg.family!r}: one of tests/model_sweep_configs.py family_names()")
    if cfg.hidden_size % TINY_HIDDEN or cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"family models need hidden_size a multiple of {TINY_HIDDEN} and of num_heads, and "
                         f"num_heads a multiple of num_kv_heads; got {cfg.hidden_size}, {cfg.num_heads}, "
                         f"{cfg.num_kv_heads}")
    tiny = build_config(cfg.family)
    scale = cfg.hidden_size // TINY_HIDDEN
    updates = dict(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=max(cfg.seq_lens),
        num_hidden_layers=cfg.num_layers, use_cache=False,
    )
    updates.update({k: getattr(tiny, k) * scale for k in MIXER_WIDTHS if getattr(tiny, k, None) is not None})
    updates.update({k: 64 for k in CHUNKS if getattr(tiny, k, None) is not None})
    for key in PER_LAYER:
        types = getattr(tiny, key, None)
        if isinstance(types, list):
            if cfg.num_layers < len(types):
                raise ValueError(f"{cfg.family} has {len(types)} layer types ({types}): num_layers must be at "
                                 f"least that, got {cfg.num_layers}")
            updates[key] = [types[i % len(types)] for i in range(cfg.num_layers)]
    # Rebuilt from its dict, so that the config class checks and derives what it does.
    return type(tiny).from_dict({**tiny.to_dict(), **updates})


def build_model(cfg: StepConfig, attn_implementation: str = "ring_flash"):
    """The step's model (``cfg.family``'s, or the default Llama), seeded, float32."""
    import hf_ring  # noqa: F401  (registers ring_flash)
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if cfg.family is not None:
        return AutoModelForCausalLM.from_config(family_config(cfg), attn_implementation=attn_implementation).float()
    model_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=max(cfg.seq_lens),
        use_cache=False,
    )
    return LlamaForCausalLM._from_config(model_cfg, attn_implementation=attn_implementation)


@contextmanager
def hf_ring_one_process_mixers(model) -> Iterator[list[str]]:
    """While active, the mixing functions of ``model``'s token mixers (those hf_ring
    routes) run hf_ring's ops in one process (``context_parallel_gated_delta_rule`` /
    ``context_parallel_causal_conv1d`` over a world of one, in a process where
    torch.distributed is not initialised or has a world of one: the scan and conv each rank
    runs under CP, on the whole sequence). Patches the modeling modules' functions of this
    process, restored on exit; yields their names."""
    import importlib

    from hf_ring.mixers import context_parallel_causal_conv1d, context_parallel_gated_delta_rule
    from hf_ring.patches.transformers.mixers import route_of

    def delta_rule(query, key, value, g=None, beta=None, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        return context_parallel_gated_delta_rule(
            query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        return context_parallel_causal_conv1d(hidden_states, weight, bias, activation=activation)

    ops = {"torch_chunk_gated_delta_rule": delta_rule, "causal_conv1d_fn": conv}
    originals = {}
    for cls in {type(m) for m in model.modules() if route_of(type(m)) is not None}:
        module = importlib.import_module(cls.__module__)
        for name in route_of(cls).runs:
            if name not in ops:
                raise NotImplementedError(f"no one-process hf_ring op for {name} ({cls.__name__})")
            originals.setdefault((module, name), getattr(module, name))
    try:
        for module, name in originals:
            setattr(module, name, ops[name])
        yield sorted(f"{module.__name__}.{name}" for module, name in originals)
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


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

    torch.set_num_threads(cfg.threads_per_process)
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=cfg.cp_size)
    state = hf_ring.setup_context_parallel(cfg.cp_size)
    baseline_mb = _rss_mb()
    model = build_model(cfg).to(device)
    mixers = hf_ring_one_process_mixers(model) if cfg.mixer_impl == "hf_ring" else nullcontext()
    model.train()
    offload_stats: dict = {}
    if cfg.offload_checkpoints:
        hf_ring.enable_offloaded_checkpointing(model, offload_stats)
    if cfg.tiled_mlp:
        hf_ring.tile_mlps(model, cfg.tiled_mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = []
    with mixers:
        for seq_len in cfg.seq_lens:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            results.append(_measure(model, opt, cfg, state, seq_len, device, sync, baseline_mb))
            results[-1]["offloaded_peak_mb"] = offload_stats.pop("peak_bytes", 0) / 2**20
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    # The results are on disk. Interpreter teardown can still abort the process ("terminate called
    # without an active exception": a gloo worker thread destroyed while joinable, seen once in a
    # suite run of the cp=2 world), which mp.spawn reports as a failed run; skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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

    def step(stats: Optional[CommWaitStats] = None, marks: Optional[list] = None) -> None:
        # marks: receives (wall, CPU) clock readings after the backward, the gradients'
        # all-reduce and the optimizer step.
        def mark() -> None:
            if marks is not None:
                marks.append((time.perf_counter(), time.process_time()))

        # The guard hands the sink down to every ring call of the forward (and its backward).
        inputs = dict(input_ids=ids_l, position_ids=pos_l, hf_ring_comm_stats=stats)
        if cfg.chunked_loss:
            chunking = ChunkedLossConfig(True, cfg.loss_chunk_tokens)
            token_sum, _ = model_token_loss_sum(model, model, inputs, labels_l, chunking)
        else:
            token_sum = token_loss_sum(model(**inputs).logits, labels_l)
        loss_share(token_sum, n_valid).backward()
        mark()
        if cfg.cp_size > 1:
            # Each rank's loss is its share of the global token mean, so the model's
            # gradient is the sum of the ranks' gradients.
            for p in model.parameters():
                if p.grad is not None:  # the same on every rank: one model, every token's loss
                    dist.all_reduce(p.grad, group=state.cp_group)
        mark()
        if cfg.phase_peaks:
            phases["backward"] = _hwm_mb()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()

    for _ in range(cfg.warmup):
        step()
    times, cpu_times, accounts = [], [], []
    for _ in range(cfg.steps):
        sync()
        dist.barrier()
        if cfg.phase_peaks:
            _reset_hwm()
        timer = _layer_timer(model) if cfg.account_layers else None
        with timer.active() if timer is not None else nullcontext():
            marks = [(time.perf_counter(), time.process_time())]
            step(waits, marks)
            sync()
            marks[-1] = (time.perf_counter(), time.process_time())  # the step's end, synced
        times.append(marks[-1][0] - marks[0][0])
        cpu_times.append(marks[-1][1] - marks[0][1])
        if timer is not None:
            accounts.append(_step_account(timer, marks))
    peak = _peak_mb(device) - (baseline_mb if device.type == "cpu" else 0.0)
    if cfg.phase_peaks:
        phases = {"peak_backward_mb": phases["backward"] - baseline_mb, "peak_step_mb": _hwm_mb() - baseline_mb}
    if cfg.account_layers:
        from layer_accounting import saved_bytes

        phases["step_accounts"] = accounts
        phases["saved_bytes"] = saved_bytes(
            model, lambda: token_loss_sum(model(input_ids=ids_l, position_ids=pos_l).logits, labels_l), listing=True)
    return {
        **phases,
        "seq_len": seq_len,
        "step_seconds": sorted(times)[len(times) // 2],
        "cpu_seconds": sorted(cpu_times)[len(cpu_times) // 2],  # this process's CPU time, every thread
        "step_seconds_min": min(times), "cpu_seconds_min": min(cpu_times),
        "comm_wait_seconds": waits.seconds / cfg.steps,
        "peak_mb": peak,
        "runtime_baseline_mb": baseline_mb if device.type == "cpu" else 0.0,
    }


def _layer_timer(model):
    from layer_accounting import LayerTimer

    return LayerTimer(model)


def _step_account(timer, marks: list) -> dict:
    """One timed step by kind of layer (the timer's) and phase (``marks``: the step's start,
    the ends of the backward, of the gradients' all-reduce, of the optimizer step; wall
    and CPU clock readings)."""
    start, backward_done, reduced, end = marks
    span = lambda a, b: {"wall": b[0] - a[0], "cpu": b[1] - a[1]}  # noqa: E731
    return {"layer_seconds": timer.seconds, "step": span(start, end),
            "phase_seconds": {"grad_all_reduce": span(backward_done, reduced), "optimizer": span(reduced, end)}}


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
            **{k: max(r[k] for r in per_rank) for k in ("cpu_seconds", "step_seconds_min", "cpu_seconds_min")},
            "comm_wait_seconds": slowest["comm_wait_seconds"],
            "peak_mb_per_process": max(r["peak_mb"] for r in per_rank),
            "runtime_baseline_mb": max(r["runtime_baseline_mb"] for r in per_rank),
            "offloaded_peak_mb": max(r.get("offloaded_peak_mb", 0.0) for r in per_rank),
            **{k: max(r[k] for r in per_rank) for k in ("peak_backward_mb", "peak_step_mb") if k in per_rank[0]},
        })
        if cfg.account_layers:  # every rank's
            merged[-1]["accounting_per_rank"] = [{k: r[k] for k in ("step_accounts", "saved_bytes")} for r in per_rank]
    return merged
