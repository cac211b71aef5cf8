"""Peak memory per process of one GRPO policy step at long rollouts with a Llama-3-sized
vocabulary (128,256): TRL's fused LM head by chunks (what ``RingGRPOTrainer`` runs) against
full logits, at cp 1 and under context parallelism.

What one step is here (``RingGRPOTrainer``'s work between generation and the optimizer, TRL's
loss type ``grpo``, ``beta`` 0.04, ``num_iterations`` 1): the reference model's per-token
log-probabilities of every completion token without gradients, the policy's with gradients
(and their entropies, as TRL's metrics read them), TRL's clipped-ratio loss with the KL to the
reference, and its backward. A CP group scores ``--rollouts`` rollouts (default 2, the fewest
cp 2 takes: each rank holds an equal slice) of ``tokens`` each (a ``--prompt-tokens`` prompt
and its completion), so a process holds ``rollouts x tokens / cp`` tokens.

Heads:

- ``chunked``: TRL's ``add_fused_lm_head`` (``outputs=("log_probs", "entropy")`` on the
  policy, ``("log_probs",)`` on the reference). At cp 1 the model is called as TRL's
  ``_get_per_token_logps_and_entropies`` calls it; under CP through hf_ring's
  ``completion_log_probs`` and ``RingFusedForward`` (the trainer's own path). TRL projects
  tiles of 4,096 positions x 32,768 vocabulary entries, never a ``(tokens, vocab)`` tensor.
- ``full``: the model's own ``(rows, seq, vocab)`` float32 logits, then TRL's
  ``selective_log_softmax`` (gather and a per-row logsumexp: TRL's non-fused path) and, for
  the policy, ``entropy_from_logits`` without gradients; under CP the same function stands in
  for the fused head inside ``RingFusedForward`` (each rank's shard of the logits).

Both heads compute the same loss and gradient (printed: ``loss``, ``grad_norm``, the latter
after DDP's average over the CP group; the smoke test compares them).

Peak memory: every configuration runs in fresh spawned processes (gloo, ``cp`` of them) with
glibc's mmap threshold pinned at 64 KiB, so every tensor above it has its own mapping and
leaves the resident set when freed; the high-water mark of the resident set is reset
(``/proc/self/clear_refs``) right before the step, after the models and rollouts exist, and
the figure is the high-water mark after the backward minus the resident set at the reset:
what the step allocates and touches (activations, logits or tiles, their gradients and
temporaries, the parameters' gradients), the largest over the group's processes. A GPU's
allocator peak would count the same tensors; torch's profiler would count tensors only,
missing what the kernels' own scratch memory costs. Analytic figures beside it: ``full``,
``tokens x vocab x 4`` bytes twice (the logits and their gradient); ``chunked``, one tile
``min(tokens, 4096) x min(vocab, 32768) x 4``. On CPU TRL folds each tile with torch ops that
allocate several tile-sized temporaries (a GPU runs a Triton kernel there instead), so the
measured chunked peak is a few tiles, independent of the rollout's length.

A configuration whose estimated peak (``estimate_bytes``: a bound fitted to these
measurements) exceeds ``--cap-gib`` per process (default 8), or whose processes together would
exceed the memory the machine has available, is not run: its line says so, with the analytic
figures. Each process also runs under an address-space limit of its start-up size plus the cap.

    python benchmarks/rl_logprob_memory.py                 # 8k and 32k tokens, cp 1 and 2: ~45 min on 2 busy cores
    python benchmarks/rl_logprob_memory.py --quick         # 2k and 8k tokens
    python benchmarks/rl_logprob_memory.py --tiny          # smoke test: 256 tokens, a 1-layer model
    python benchmarks/rl_logprob_memory.py --tokens 1024 4096 --cp 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_world import _hwm_mb, _reset_hwm, _rss_mb  # noqa: E402

LLAMA3_VOCAB = 128_256
# TRL's tile (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE).
TILE_TOKENS, TILE_VOCAB = 4096, 32768
MIB = 2**20


@dataclass(frozen=True)
class Config:
    tokens: int  # per rollout: prompt + completion
    cp: int
    head: str  # "chunked" or "full"
    rollouts: int = 2
    prompt_tokens: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = LLAMA3_VOCAB
    threads: int = 2

    @property
    def tokens_per_process(self) -> int:
        return self.rollouts * self.tokens // self.cp


def analytic_bytes(cfg: Config) -> int:
    """The head's tensor the analysis names: full, the float32 logits and their gradient
    (``2 x tokens x vocab x 4``); chunked, one of TRL's tiles."""
    n = cfg.tokens_per_process
    if cfg.head == "full":
        return 2 * n * cfg.vocab * 4
    return min(n, TILE_TOKENS) * min(cfg.vocab, TILE_VOCAB) * 4


def estimate_bytes(cfg: Config) -> int:
    """A bound on the measured peak, used to decide what to run: the full logits about 3.5
    times over (logits, the gathered and logsumexp gradients, their sum), or TRL's CPU tile
    fold about 10 tiles; plus 3 KiB per token and layer of activations and 5 parameter-sized
    copies of the embeddings and head (their gradients and the reference's)."""
    head = 1.75 * analytic_bytes(cfg) if cfg.head == "full" else 10 * analytic_bytes(cfg)
    activations = 3 * 1024 * cfg.tokens_per_process * cfg.layers
    return int(head + activations + 5 * cfg.vocab * cfg.hidden * 4)


class FullLogitsHead:
    """Stands in for TRL's fused head (``model(..., labels | shift_labels, fused_lm_head=True)``
    returning per-token ``log_probs`` / ``entropy`` ``(rows, seq - 1)``, or ``(rows, seq)`` with
    ``shift_labels``) through the model's full ``(rows, seq, vocab)`` logits."""

    def __init__(self, model: torch.nn.Module, entropy: bool):
        self.model, self.entropy = model, entropy

    def __call__(self, *, labels=None, shift_labels=None, fused_lm_head: bool = True, **inputs):
        from trl.trainer.utils import FusedCausalLMOutput, entropy_from_logits, selective_log_softmax

        logits = self.model(**inputs).logits  # (rows, seq, vocab) float32
        if shift_labels is None:
            logits, shift_labels = logits[:, :-1], labels[:, 1:]
        mask = shift_labels != -100
        log_probs = selective_log_softmax(logits, shift_labels.clamp(min=0)).masked_fill(~mask, 0)
        entropy = None
        if self.entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits).masked_fill(~mask, 0)
        return FusedCausalLMOutput(log_probs=log_probs, entropy=entropy, label_mask=mask)


def _models(cfg: Config):
    """(policy, reference) as ``cfg.head`` calls them: a seeded Llama with ring attention, float32."""
    import copy

    import hf_ring  # noqa: F401  (registers ring_flash)
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.tokens, use_cache=False)
    policy = LlamaForCausalLM._from_config(config, attn_implementation="ring_flash")
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if cfg.head == "full":
        return FullLogitsHead(policy, entropy=True), FullLogitsHead(reference, entropy=False), policy
    add_fused_lm_head(policy, outputs=("log_probs", "entropy"))
    add_fused_lm_head(reference)
    return policy, reference, policy


def _completion_log_probs(model, state, ids: torch.Tensor, mask: torch.Tensor, completion: int, entropy: bool):
    """Per-completion-token log-probs (and entropies) ``(rows, completion)`` of this rank's rows,
    as ``RingRolloutTrainer._get_per_token_logps_and_entropies`` computes them."""
    if state.cp_size == 1:  # TRL's own call
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-completion] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -completion:], out.entropy[:, -completion:] if entropy else None
    from hf_ring.training.trl.completion_rows import completion_log_probs
    from hf_ring.training.trl.fused_forward import RingFusedForward

    return completion_log_probs(RingFusedForward(model, state, 0), ids, mask, completion, entropy)


def _grpo_loss(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, advantages: torch.Tensor,
               beta: float = 0.04, epsilon: float = 0.2) -> torch.Tensor:
    """TRL's ``grpo`` loss of ``(rows, C)`` log-probs (every completion token real), ``num_iterations`` 1."""
    coef_1 = torch.exp(log_probs - log_probs.detach())
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    delta = ref_log_probs - log_probs
    per_token = per_token + beta * (torch.exp(delta) - delta - 1)
    return per_token.mean(dim=1).mean()


def _measure(cfg: Config, state) -> dict:
    import gc

    policy, reference, params = _models(cfg)
    gen = torch.Generator().manual_seed(cfg.tokens)
    ids = torch.randint(0, cfg.vocab, (cfg.rollouts, cfg.tokens), generator=gen)
    advantages = torch.randn(cfg.rollouts, generator=gen)
    share = cfg.rollouts // cfg.cp
    mine = slice(state.cp_rank * share, (state.cp_rank + 1) * share)
    ids, advantages = ids[mine], advantages[mine]
    mask = torch.ones_like(ids)
    completion = cfg.tokens - cfg.prompt_tokens
    gc.collect()
    dist.barrier()
    baseline = _rss_mb()
    _reset_hwm()
    start = time.perf_counter()
    with torch.no_grad():
        ref_lp, _ = _completion_log_probs(reference, state, ids, mask, completion, False)
    after_reference = _hwm_mb() - baseline
    lp, _entropy = _completion_log_probs(policy, state, ids, mask, completion, True)
    loss = _grpo_loss(lp, ref_lp, advantages)
    loss.backward()
    peak = _hwm_mb() - baseline
    seconds = time.perf_counter() - start
    # DDP's average over the CP group: the gradient (and the loss) of the group's rollouts.
    grads = torch.cat([p.grad.flatten() for p in params.parameters()])
    group_loss = loss.detach().clone()
    for t in (grads, group_loss):
        dist.all_reduce(t, group=state.cp_group)
        t.div_(cfg.cp)
    return {"peak_mb": peak, "reference_peak_mb": after_reference, "seconds": seconds,
            "loss": float(group_loss), "grad_norm": float(grads.norm())}


def _worker(rank: int, cfg: Config, cap_bytes: int, init_file: str, out_dir: str) -> None:
    import hf_ring

    with open("/proc/self/status") as f:
        vm_kib = int(next(line for line in f if line.startswith("VmSize:")).split()[1])
    limit = vm_kib * 1024 + cap_bytes + 2**30  # start-up mappings, the cap, thread stacks
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    torch.set_num_threads(max(1, cfg.threads // cfg.cp))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.cp)
    state = hf_ring.setup_context_parallel(cfg.cp)
    result = _measure(cfg, state)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    # The result is on disk; interpreter teardown can still abort a gloo process ("terminate
    # called without an active exception", step_world.py), which mp.spawn reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        kib = next(line for line in f if line.startswith("MemAvailable:")).split()[1]
    return int(kib) * 1024


def run(cfg: Config, cap_bytes: int) -> dict:
    """One configuration's row: measured in fresh processes, or skipped with the reason."""
    row = {**asdict(cfg), "tokens_per_process": cfg.tokens_per_process,
           "analytic_mb": analytic_bytes(cfg) / MIB, "estimate_mb": estimate_bytes(cfg) / MIB}
    estimate = estimate_bytes(cfg)
    if estimate > cap_bytes:
        return {**row, "skipped": f"needs ~{estimate / 2**30:.1f} GiB per process, over the "
                                  f"{cap_bytes / 2**30:.0f} GiB cap"}
    spare = _available_bytes() - 2 * 2**30  # room left for the machine's other work
    if cfg.cp * estimate > spare:
        return {**row, "skipped": f"{cfg.cp} processes of ~{estimate / 2**30:.1f} GiB: the machine has "
                                  f"{spare / 2**30:.1f} GiB to spare now"}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # read by the spawned processes' glibc
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(cfg, cap_bytes, os.path.join(tmp, "rdzv"), tmp), nprocs=cfg.cp, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(cfg.cp)]
    return {**row, **{k: max(r[k] for r in ranks) for k in ("peak_mb", "reference_peak_mb", "seconds")},
            "loss": ranks[0]["loss"], "grad_norm": ranks[0]["grad_norm"]}


def _print_row(row: dict) -> None:
    head = (f"{row['tokens']:>7,} {row['cp']:>3} {row['head']:<8} {row['tokens_per_process']:>9,} "
            f"{row['analytic_mb']:>10,.0f}")
    if "skipped" in row:
        print(f"{head} {'-':>10} {'-':>9}  not run: {row['skipped']}", flush=True)
    else:
        print(f"{head} {row['peak_mb']:>10,.0f} {row['reference_peak_mb']:>9,.0f} {row['estimate_mb']:>9,.0f} "
              f"{row['loss']:>11.7f} {row['grad_norm']:>11.7f} {row['seconds']:>7.1f}", flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rollout (default 8192 32768)")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--heads", nargs="+", default=["chunked", "full"], choices=["chunked", "full"])
    ap.add_argument("--rollouts", type=int, default=2, help="rollouts per CP group and step")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=LLAMA3_VOCAB)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="split over a group's processes")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="largest peak a process may reach")
    ap.add_argument("--quick", action="store_true", help="2k and 8k tokens per rollout")
    ap.add_argument("--tiny", action="store_true", help="smoke test: 256 tokens, a 1-layer model, 32 hidden")
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    ap.add_argument("--out", default=None, help="also write every row to this JSON file")
    args = ap.parse_args(argv)
    tokens = args.tokens or ([256] if args.tiny else [2048, 8192] if args.quick else [8192, 32768])
    base = Config(tokens=0, cp=1, head="chunked", rollouts=args.rollouts, vocab=args.vocab, threads=args.threads,
                  prompt_tokens=64 if args.tiny else args.prompt_tokens)
    if args.tiny:
        base = replace(base, hidden=32, layers=1, intermediate=64)
    for cp in args.cp:
        if args.rollouts % cp:
            raise ValueError(f"--rollouts {args.rollouts} must be a multiple of every cp (got {cp})")
    if not args.json:
        print(f"GRPO step, vocab {args.vocab:,}, {args.rollouts} rollouts per CP group, hidden {base.hidden}, "
              f"{base.layers} layers; MB = 2^20 bytes, peak per process\n"
              f"{'tokens':>7} {'cp':>3} {'head':<8} {'tok/proc':>9} {'analytic':>10} {'peak':>10} {'ref peak':>9} "
              f"{'estimate':>9} {'loss':>11} {'grad_norm':>11} {'seconds':>7}")
    rows = []
    for n in tokens:
        for cp in args.cp:
            for head in args.heads:
                row = run(replace(base, tokens=n, cp=cp, head=head), int(args.cap_gib * 2**30))
                rows.append(row)
                print(json.dumps(row), flush=True) if args.json else _print_row(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
