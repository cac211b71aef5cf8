"""Context parallelism for your own attention module: ``hf_ring.ContextParallel.wrap``.

``GQAttention`` below is a plain grouped-query attention block (no transformers): Q/K/V
projections, rotary position embeddings computed from the positions it is given, and
``torch.nn.functional.scaled_dot_product_attention``. Wrapped, each rank feeds it its
shard of the sequence and the shard's global positions; the SDPA call inside runs across
the context-parallel group, and the block computes exactly what it computes unwrapped on
the full sequence. This script checks that on every rank (output, input gradient, weight
gradients) and prints the errors.

Run on CPU with two processes::

    torchrun --nproc_per_node 2 examples/context_parallel_wrap.py
    torchrun --nproc_per_node 2 examples/context_parallel_wrap.py --pattern ulysses --layout stripe --seq_len 512
    torchrun --nproc_per_node 4 examples/context_parallel_wrap.py --pattern hybrid --ulysses_size 2
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hf_ring


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(batch, seq, heads, head_dim)`` at ``positions`` ``(seq,)``
    int: the angle of a token depends on its global position only."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)  # (half,)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]  # (seq, half)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class GQAttention(nn.Module):
    """Causal grouped-query self-attention with RoPE.

    ``repeat_kv=False`` hands SDPA K/V with their own head count (``enable_gqa=True``);
    ``repeat_kv=True`` repeats them to the query heads first (what older code does).
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, causal: bool = True,
                 repeat_kv: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.causal, self.repeat_kv = causal, repeat_kv
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x ``(batch, seq, hidden)``; positions ``(seq,)`` int, the tokens' global positions."""
        b, s, _ = x.shape
        q = rotate(self.q_proj(x).view(b, s, self.n_heads, self.head_dim), positions)
        k = rotate(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if self.repeat_kv:
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=not self.repeat_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default="ring", choices=["ring", "allgather", "ulysses", "hybrid", "auto"])
    parser.add_argument("--ulysses_size", type=int, default=None, help="--pattern hybrid: ranks per Ulysses group")
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "stripe", "contiguous"])
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("hf_ring").setLevel(logging.INFO)  # --pattern auto says what it picked and why
    dist.init_process_group("gloo")  # one CP group over the whole world
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights and inputs on every rank
    block = GQAttention(args.hidden, args.heads, args.kv_heads, args.hidden // args.heads)
    x_full = torch.randn(args.batch, args.seq_len, args.hidden)
    grad_out = torch.randn(args.batch, args.seq_len, args.hidden)

    # The reference: the plain block on the full sequence, in one process.
    x_ref = x_full.clone().requires_grad_()
    want = block(x_ref, torch.arange(args.seq_len))
    want.backward(grad_out)
    want_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()

    # Context parallel: this rank's shard of the hidden states and its global positions.
    wrapped = hf_ring.ContextParallel.wrap(block, cp_group=None, pattern=args.pattern, causal=True,
                                           layout=args.layout, ulysses_size=args.ulysses_size)
    x = wrapped.shard(x_full).requires_grad_()
    out = wrapped(x, wrapped.positions(args.seq_len))
    out.backward(wrapped.shard(grad_out))
    for p in wrapped.parameters():  # each rank holds its tokens' share of the weight gradients
        dist.all_reduce(p.grad)

    errors = {"output": rel_err(out, wrapped.shard(want)), "input grad": rel_err(x.grad, wrapped.shard(x_ref.grad))}
    errors.update({f"{n} grad": rel_err(p.grad, want_grads[n]) for n, p in block.named_parameters()})
    worst = max(errors.values())
    print(f"rank {rank}/{world} pattern={args.pattern} layout={args.layout} seq={args.seq_len}: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    dist.destroy_process_group()
    if worst > 1e-5:  # float32 attention in another summation order: ~1e-7 expected
        raise SystemExit(f"rank {rank}: relative error {worst:.2e} above 1e-5")


if __name__ == "__main__":
    main()
