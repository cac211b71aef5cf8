"""Memory and communication per rank for each axis of the N-D mesh: a model, not a measurement.

Why it exists: hf_ring lays tp, cp, dp_shard, dp_replicate (and transformers' ep) on one
mesh (``hf_ring/distributed/mesh.py``), TP innermost and the data axes outermost. This
script puts figures on that order: for a model shape, a sequence length and a layout, the
bytes each rank holds and the bytes each rank sends per optimizer step, split by axis, so
that one can see which axis moves the most and must sit on the fastest links.

What it models, per rank and per optimizer step (one sequence of ``S`` tokens per
data-parallel replica, micro-batch 1, full activation checkpointing, bf16 activations):

- memory: the sharded model state (FSDP2's mixed precision: fp32 weights, fp32 gradients,
  AdamW's two fp32 moments, 16 bytes per parameter, sharded over ``dp_shard x cp``, TP's
  shards and EP's experts); one layer's gathered bf16 weights and gradients; every layer's
  checkpointed input; the peak working set of one layer's recompute + backward (attention,
  MLP or routed experts, the ring's K/V and dK/dV buffers); the loss (LM head and one chunk
  of logits). See :func:`memory`.
- communication: bytes each rank sends, by axis: TP all-reduces, the CP ring (and the
  all-gather pattern for comparison), FSDP's all-gathers and reduce-scatters, EP's
  all-to-alls, the replicas' all-reduce. See :func:`communication`.
- time, as an order of magnitude only: those bytes over an assumed link bandwidth (inside
  or across a node, from where the axis sits in the mesh), beside the step's FLOPs over an
  assumed throughput; and the shortest ``S / cp`` at which the ring's transfers hide behind
  its attention compute.

Every formula is in the docstring of the function that computes it; docs/parallelism_costs.md
states them in words, with this script's tables. Nothing here is measured except where
that page says so (the CP ring's bytes, counted on a 2-process gloo run).

Must not import torch, transformers, or hf_ring's layers: plain Python and dataclasses, so
that it runs anywhere in well under a second.

    python benchmarks/nd_cost_model.py                 # both models, every default layout
    python benchmarks/nd_cost_model.py --model llama3_8b --layouts cp8 tp2xcp4 --seq 262144
    python benchmarks/nd_cost_model.py --json          # one JSON object
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

GiB = 2**30
GB = 1e9
MESH_ORDER = ("tp", "cp", "dp_shard", "dp_replicate")  # innermost first: a rank's place in a node


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (what the costs depend on; no weights).

    Attributes:
        name: a label for the tables.
        layers, hidden, heads, kv_heads, head_dim: the attention stack.
        mlp: the dense MLP's intermediate size (0 for an MoE whose every layer routes).
        vocab: vocabulary size; the embedding and the LM head are untied (two matrices).
        experts, top_k, expert_mlp: routed experts per layer, experts per token, and each
            expert's intermediate size (all 0 for a dense model). No shared expert.
        qk_norm: per-head RMSNorm on q and k (Qwen3): 2 x head_dim replicated weights.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_mlp: int = 0
    qk_norm: bool = False

    def __post_init__(self) -> None:
        _positive(f"model {self.name}", layers=self.layers, hidden=self.hidden, heads=self.heads,
                  kv_heads=self.kv_heads, head_dim=self.head_dim, vocab=self.vocab)
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        moe = (self.experts, self.top_k, self.expert_mlp)
        if any(moe) and not (all(x > 0 for x in moe) and self.top_k <= self.experts):
            raise ValueError(f"model {self.name}: an MoE needs experts, top_k <= experts and expert_mlp all positive, "
                             f"got {moe}")
        if not any(moe) and self.mlp < 1:
            raise ValueError(f"model {self.name}: a dense model needs mlp > 0 (or give experts, top_k, expert_mlp)")

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def gqa_group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh's axes, as ``parse_layout`` reads them (``"dp2xtp8xcp4"``).

    Attributes:
        name: the layout as written.
        tp: tensor-parallel ranks (innermost); cp: context-parallel ranks;
        dp_shard: data-parallel ranks that FSDP shards over (with the cp ranks);
        dp_replicate: replicas (HSDP's replicate dimension);
        ep: expert-parallel ranks: the innermost ``ep`` ranks of ``dp_shard x cp``, as
            transformers' expert mesh lays them (it adds no ranks to the world).
    """

    name: str
    tp: int = 1
    cp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _positive(f"layout {self.name}", tp=self.tp, cp=self.cp, dp_shard=self.dp_shard,
                  dp_replicate=self.dp_replicate, ep=self.ep)
        if self.fsdp % self.ep:
            raise ValueError(f"layout {self.name}: ep ({self.ep}) must divide dp_shard x cp ({self.fsdp}): EP spans "
                             "the data and context ranks that hold different tokens")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(f"layout {self.name}: EP beside TP is refused by hf_ring (the EP group would hold TP "
                             "ranks, which share their tokens); use tp 1 or ep 1")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp_shard * self.dp_replicate

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards the dense weights over: ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them: ``dp_shard x cp / ep``."""
        return self.fsdp // self.ep

    def span(self, axis: str) -> int:
        """Consecutive global ranks one group of ``axis`` covers: its size times every inner
        axis's (the group fits a node when this does). ``fsdp`` is ``dp_shard x cp``; ``ep``
        is the innermost ``ep`` ranks of it."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate}
        if axis == "ep":
            return self.tp * self.ep
        if axis == "fsdp":
            return self.tp * self.cp * self.dp_shard
        return math.prod(sizes[a] for a in MESH_ORDER[:MESH_ORDER.index(axis) + 1])


@dataclass(frozen=True)
class Assumptions:
    """What the figures assume (all stated in the JSON and on the doc page).

    Attributes:
        seq: tokens per sequence (one sequence per data-parallel replica and step).
        act_bytes: bytes per activation element (bf16).
        acc_bytes: bytes of the ring's dK/dV and dq accumulators and of the all-gather
            pattern's dK/dV shares (float32 for bf16 inputs, as hf_ring's ring keeps them).
        state_bytes: bytes per parameter of sharded model state (FSDP2 mixed precision:
            fp32 weight, fp32 gradient, two fp32 AdamW moments).
        gather_bytes: bytes per parameter of FSDP's all-gather (bf16 compute weights).
        reduce_bytes: bytes per parameter of gradient reduction (fp32 reduce_dtype).
        loss_chunk_bytes: float32 logits of one loss chunk (hf_ring's default: 64 MiB).
        checkpointing: full activation checkpointing (every layer recomputed in backward).
        node: GPUs per node (an axis group spanning more ranks crosses nodes).
        intra_gbps, inter_gbps: bytes per second one GPU sends, in GB/s, inside a node
            (NVLink 4: 450) and across nodes (one 400 Gb/s NIC per GPU: 50).
        tflops: sustained bf16 throughput per GPU for the step's matmuls and attention.
    """

    seq: int = 131072
    act_bytes: int = 2
    acc_bytes: int = 4
    state_bytes: int = 16
    gather_bytes: int = 2
    reduce_bytes: int = 4
    loss_chunk_bytes: int = 64 * 2**20
    checkpointing: bool = True
    node: int = 8
    intra_gbps: float = 450.0
    inter_gbps: float = 50.0
    tflops: float = 400.0

    def __post_init__(self) -> None:
        _positive("assumptions", seq=self.seq, act_bytes=self.act_bytes, acc_bytes=self.acc_bytes,
                  state_bytes=self.state_bytes, gather_bytes=self.gather_bytes, reduce_bytes=self.reduce_bytes,
                  loss_chunk_bytes=self.loss_chunk_bytes, node=self.node)
        for name in ("intra_gbps", "inter_gbps", "tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"assumptions: {name} must be positive, got {getattr(self, name)!r}")


# -- what one rank holds -------------------------------------------------------------------


@dataclass(frozen=True)
class LocalShape:
    """One rank's slice of the model under a layout: tokens, heads and columns it holds.

    ``kv_heads`` is at least 1: with ``tp > kv_heads`` each K/V head is replicated over
    ``tp / kv_heads`` ranks (Megatron's way; transformers' TP plan splits k_proj and v_proj
    by columns and cannot run it, see the doc page).
    """

    tokens: int
    heads: int
    kv_heads: int
    mlp: int
    expert_mlp: int
    vocab: int


def local_shape(m: ModelShape, lay: Layout, a: Assumptions) -> LocalShape:
    """``tokens = S / cp`` (every TP rank holds all of them: no sequence parallelism);
    heads, MLP columns and vocabulary divided by ``tp``."""
    if a.seq % (2 * lay.cp):
        raise ValueError(f"seq {a.seq} must be a multiple of 2 x cp = {2 * lay.cp} (zigzag halves each rank's shard)")
    if m.heads % lay.tp:
        raise ValueError(f"{m.name}: tp {lay.tp} must divide the {m.heads} query heads")
    if m.kv_heads % lay.tp and lay.tp % m.kv_heads:
        raise ValueError(f"{m.name}: tp {lay.tp} and the {m.kv_heads} K/V heads must divide one another")
    if lay.ep > 1 and (not m.moe or m.experts % lay.ep):
        raise ValueError(f"{m.name}: ep {lay.ep} needs an MoE whose experts ({m.experts}) it divides; use ep 1")
    return LocalShape(tokens=a.seq // lay.cp, heads=m.heads // lay.tp, kv_heads=max(1, m.kv_heads // lay.tp),
                      mlp=math.ceil(m.mlp / lay.tp), expert_mlp=math.ceil(m.expert_mlp / lay.tp),
                      vocab=math.ceil(m.vocab / lay.tp))


@dataclass(frozen=True)
class LocalParams:
    """Parameters one rank computes with before FSDP shards them (after TP and EP).

    ``layer_dense``: one layer's attention, norms, router and dense MLP; ``layer_experts``:
    one layer's experts on this rank (``experts / ep``, columns ``/ tp``); ``embed``,
    ``head``: vocabulary-sharded over ``tp``.
    """

    layer_dense: int
    layer_experts: int
    embed: int
    head: int
    final_norm: int

    def dense_total(self, layers: int) -> int:
        return layers * self.layer_dense + self.embed + self.head + self.final_norm

    def experts_total(self, layers: int) -> int:
        return layers * self.layer_experts


def local_params(m: ModelShape, lay: Layout, a: Assumptions) -> LocalParams:
    """q, o: ``hidden x local heads x head_dim``; k, v: ``hidden x local K/V heads x
    head_dim``; norms replicated (2 x hidden, plus q/k norms); dense MLP ``3 x hidden x
    local columns``; router ``hidden x experts`` (replicated); experts ``experts / ep x 3 x
    hidden x local expert columns``; embedding and head ``local vocab x hidden`` each."""
    ls = local_shape(m, lay, a)
    attn = 2 * m.hidden * ls.heads * m.head_dim + 2 * m.hidden * ls.kv_heads * m.head_dim
    norms = 2 * m.hidden + (2 * m.head_dim if m.qk_norm else 0)
    dense_mlp = 3 * m.hidden * ls.mlp if m.mlp else 0
    router = m.hidden * m.experts
    experts = (m.experts // lay.ep) * 3 * m.hidden * ls.expert_mlp if m.moe else 0
    return LocalParams(layer_dense=attn + norms + dense_mlp + router, layer_experts=experts,
                       embed=ls.vocab * m.hidden, head=ls.vocab * m.hidden, final_norm=m.hidden)


def total_params(m: ModelShape) -> int:
    """Every parameter of the model (one rank, no parallelism)."""
    p = local_params(m, Layout("1"), Assumptions(seq=2))
    return p.dense_total(m.layers) + p.experts_total(m.layers)


# -- memory --------------------------------------------------------------------------------


def ring_buffers(ls: LocalShape, m: ModelShape, cp: int, a: Assumptions) -> int:
    """The ring's buffers at its backward (larger than its forward's): ``min(2, cp - 1)``
    received K/V blocks (``2 x tokens x local K/V heads x head_dim``, activation dtype),
    two dK/dV accumulators (the one computed on, the one in flight; float32) and the
    float32 dq accumulator. None without CP."""
    if cp == 1:
        return 0
    kv_elems = 2 * ls.tokens * ls.kv_heads * m.head_dim
    return (min(2, cp - 1) * kv_elems * a.act_bytes + 2 * kv_elems * a.acc_bytes
            + ls.tokens * ls.heads * m.head_dim * a.acc_bytes)


def attention_saved(ls: LocalShape, m: ModelShape, a: Assumptions) -> int:
    """What one layer's recompute keeps for the attention's backward: the norm's output
    (``tokens x hidden``), q, k, v before and q, k after rotary embedding, the attention
    output (local heads), and the float32 log-sum-exp (``tokens x local heads``)."""
    qd, kvd = ls.heads * m.head_dim, ls.kv_heads * m.head_dim
    return ls.tokens * ((m.hidden + 3 * qd + 3 * kvd) * a.act_bytes + ls.heads * 4)


def attention_backward(ls: LocalShape, m: ModelShape, a: Assumptions) -> int:
    """The attention's backward transients: the output's gradient, dq, dk, dv (activation
    dtype), beside the ring's buffers."""
    qd, kvd = ls.heads * m.head_dim, ls.kv_heads * m.head_dim
    return ls.tokens * (2 * qd + 2 * kvd) * a.act_bytes


def mlp_working(ls: LocalShape, m: ModelShape, lay: Layout, a: Assumptions) -> int:
    """The MLP's saved activations plus its backward transients, one layer.

    Dense: the norm's output, gate, up, act(gate) and act(gate) * up (``tokens x local
    columns`` each), then two column-sized gradients in the backward.
    MoE (routing balanced): the norm's output, float32 router logits (``tokens x experts``),
    the ``tokens x top_k`` dispatched rows and the experts' outputs (``x hidden``; a third
    such buffer under EP, the combine's receive), gate, up, act, product (``tokens x top_k x
    local expert columns``); backward: two column-sized gradients and one hidden-sized.
    Under EP a rank's experts receive ``tokens x top_k`` rows on average: the same counts.
    """
    n = ls.tokens
    if not m.moe:
        return n * (m.hidden + 6 * ls.mlp) * a.act_bytes
    rows = n * m.top_k
    hidden_bufs = 2 + (1 if lay.ep > 1 else 0)
    router_logits = n * m.experts * 4
    expert_rows = rows * (hidden_bufs * m.hidden + 4 * ls.expert_mlp) * a.act_bytes
    saved = n * m.hidden * a.act_bytes + router_logits + expert_rows
    return saved + rows * (2 * ls.expert_mlp + m.hidden) * a.act_bytes


def loss_working(ls: LocalShape, m: ModelShape, lay: Layout, p: LocalParams, a: Assumptions) -> int:
    """The chunked loss's working set: the LM head's gathered bf16 weight (under FSDP), the
    float32 accumulator of its gradient, one chunk of float32 logits and their gradient,
    and the final hidden states with their gradient. The chunk's rows are
    ``loss_chunk_bytes / (4 x local vocab)``, so the chunk is the same bytes under TP."""
    gathered_head = p.head * a.gather_bytes if lay.fsdp > 1 else 0
    return gathered_head + p.head * 4 + 2 * a.loss_chunk_bytes + 2 * ls.tokens * m.hidden * a.act_bytes


def gathered_units(lay: Layout, p: LocalParams, a: Assumptions) -> int:
    """FSDP's transient unsharded layers: the layer computed on and the one prefetched
    (bf16 weights), and one layer's bf16 gradient with its float32 copy for the
    reduce-scatter: ``(2 x 2 + 2 + 4)`` bytes per local parameter of one layer. Only the
    parts FSDP shards (dense when ``dp_shard x cp > 1``, experts when ``efsdp > 1``);
    without FSDP the bf16 casts of autocast are not counted."""
    per_param = 2 * a.gather_bytes + a.gather_bytes + a.reduce_bytes
    sharded = p.layer_dense * (lay.fsdp > 1) + p.layer_experts * (lay.efsdp > 1)
    return per_param * sharded


def model_state(m: ModelShape, lay: Layout, p: LocalParams, a: Assumptions) -> float:
    """``state_bytes x (dense / (dp_shard x cp) + experts / efsdp)``: replicas hold the
    same shard."""
    return a.state_bytes * (p.dense_total(m.layers) / lay.fsdp + p.experts_total(m.layers) / lay.efsdp)


def memory(m: ModelShape, lay: Layout, a: Assumptions) -> dict[str, float]:
    """Bytes per rank by component, and the peak.

    ``peak = state + gathered + checkpoints + max(loss, layer)`` with
    ``layer = attention saved + max(MLP working, attention backward + ring buffers) +
    2 x tokens x hidden`` (the gradient flowing in and the residual's): the backward runs
    the MLP's first, whose activations are gone by the attention's backward; the loss's
    backward runs before any layer's. Not counted: the CUDA context, NCCL's buffers,
    the allocator's fragmentation (memory.md reserves 4 GB for them).
    """
    ls, p = local_shape(m, lay, a), local_params(m, lay, a)
    attn, attn_bwd = attention_saved(ls, m, a), attention_backward(ls, m, a)
    ring = ring_buffers(ls, m, lay.cp, a)
    mlp = mlp_working(ls, m, lay, a)
    flow = 2 * ls.tokens * m.hidden * a.act_bytes
    layer = attn + max(mlp, attn_bwd + ring) + flow
    kept = m.layers if a.checkpointing else 0
    parts = {
        "state": model_state(m, lay, p, a),
        "gathered": gathered_units(lay, p, a),
        "checkpoints": kept * ls.tokens * m.hidden * a.act_bytes,
        "attention": attn + attn_bwd,
        "mlp": mlp,
        "ring": ring,
        "loss": loss_working(ls, m, lay, p, a),
    }
    parts["peak"] = parts["state"] + parts["gathered"] + parts["checkpoints"] + max(parts["loss"], layer)
    return parts


# -- communication -------------------------------------------------------------------------


def all_reduce(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks:
    ``2 (n - 1) / n x nbytes`` (a reduce-scatter, then an all-gather)."""
    return 2 * (n - 1) / n * nbytes


def all_gather(total: float, n: int) -> float:
    """Bytes one rank sends to all-gather a ``total``-byte tensor over ``n`` ranks (or to
    reduce-scatter one): ``(n - 1) / n x total``."""
    return (n - 1) / n * total


def all_to_all(nbytes: float, n: int) -> float:
    """Bytes one rank sends in an all-to-all of its ``nbytes``, spread evenly: the
    ``(n - 1) / n`` that goes to other ranks."""
    return (n - 1) / n * nbytes


def passes(a: Assumptions) -> int:
    """Forward passes of each layer per step: the forward, and the recompute when
    checkpointing."""
    return 2 if a.checkpointing else 1


def kv_block_bytes(tokens: int, kv_heads: int, head_dim: int, act_bytes: int) -> int:
    """One rank's K and V: ``2 x tokens x K/V heads x head_dim x act_bytes`` (the block the
    ring passes on)."""
    return 2 * tokens * kv_heads * head_dim * act_bytes


def ring_bytes_per_layer(kv: float, cp: int, forwards: int, act_bytes: int, acc_bytes: int) -> float:
    """Bytes one rank sends in one layer's ring attention per step, as hf_ring's ring runs
    (``patterns/ring/attention.py``): each forward (the forward, and the recompute when
    checkpointing) passes ``cp - 1`` K/V blocks; the backward passes ``cp - 1`` K/V blocks
    again and ``cp`` hops of the dK/dV accumulator, which travels in float32 and makes one
    more hop than the K/V to come home: ``(forwards + 1)(cp - 1) KV + cp KV x acc/act``."""
    if cp == 1:
        return 0.0
    return (forwards + 1) * (cp - 1) * kv + cp * kv * acc_bytes / act_bytes


def allgather_bytes_per_layer(kv: float, cp: int, forwards: int, act_bytes: int, acc_bytes: int) -> float:
    """The all-gather pattern's (``patterns/allgather.py``): each forward all-gathers K/V,
    ``(cp - 1) KV`` sent per rank; the backward gathers them again and reduce-scatters
    the float32 dK/dV shares: ``(forwards + 1)(cp - 1) KV + (cp - 1) KV x acc/act``."""
    if cp == 1:
        return 0.0
    return (forwards + 1) * (cp - 1) * kv + (cp - 1) * kv * acc_bytes / act_bytes


def tp_bytes(m: ModelShape, lay: Layout, ls: LocalShape, a: Assumptions) -> float:
    """TP: every layer all-reduces its ``tokens x hidden`` output twice per forward (after
    o_proj and after the MLP's down projection) and its input's gradient twice per
    backward (before q/k/v and before gate/up); the recompute repeats the forward's. The
    vocabulary-sharded embedding all-reduces its output once, the vocabulary-parallel
    loss all-reduces the head input's gradient once and three float32 ``tokens`` vectors
    (max, sum of exponentials, the label's logit)."""
    if lay.tp == 1:
        return 0.0
    act = ls.tokens * m.hidden * a.act_bytes
    per_layer = (2 * passes(a) + 2) * all_reduce(act, lay.tp)
    return m.layers * per_layer + 2 * all_reduce(act, lay.tp) + 3 * all_reduce(ls.tokens * 4, lay.tp)


def fsdp_bytes(m: ModelShape, lay: Layout, p: LocalParams, a: Assumptions) -> float:
    """FSDP over ``dp_shard x cp`` (experts over ``efsdp``): each layer's bf16 weights are
    all-gathered in the forward and again in the backward (the recompute runs inside the
    backward's gather); the embedding (root) and the head (tail unit) stay unsharded from
    their forward to their backward, gathered once; every gradient is reduce-scattered in
    float32. Each is ``(n - 1) / n`` of the unsharded local bytes."""
    dense_twice = m.layers * p.layer_dense
    dense_once = p.embed + p.head + p.final_norm
    dense = (all_gather((2 * dense_twice + dense_once) * a.gather_bytes, lay.fsdp)
             + all_gather(p.dense_total(m.layers) * a.reduce_bytes, lay.fsdp))
    experts = p.experts_total(m.layers)
    expert = all_gather(experts * (2 * a.gather_bytes + a.reduce_bytes), lay.efsdp)
    return dense + expert


def ep_bytes(m: ModelShape, lay: Layout, ls: LocalShape, a: Assumptions) -> float:
    """EP: each MoE layer sends its ``tokens x top_k`` routed rows (``x hidden``) to the
    experts' ranks and gets them back (dispatch and combine, transformers' all-to-all
    ``ep_implementation``), in every forward and again (their gradients) in the backward:
    ``2 (forwards + 1)`` all-to-alls of ``tokens x top_k x hidden`` per layer, the
    ``(ep - 1) / ep`` that leaves the rank under balanced routing."""
    if not m.moe or lay.ep == 1:
        return 0.0
    rows = ls.tokens * m.top_k * m.hidden * a.act_bytes
    return m.layers * 2 * (passes(a) + 1) * all_to_all(rows, lay.ep)


def dp_bytes(m: ModelShape, lay: Layout, p: LocalParams, a: Assumptions) -> float:
    """Replicas: the float32 gradient shard each rank holds after FSDP's reduce-scatter
    (``dense / (dp_shard x cp) + experts / efsdp``) is all-reduced over ``dp_replicate``."""
    shard = p.dense_total(m.layers) / lay.fsdp + p.experts_total(m.layers) / lay.efsdp
    return all_reduce(shard * a.reduce_bytes, lay.dp_replicate)


def communication(m: ModelShape, lay: Layout, a: Assumptions) -> dict[str, float]:
    """Bytes one rank sends per step, by axis. ``cp`` is the ring's; ``cp_allgather``, the
    all-gather pattern's, is for comparison and not added to the total."""
    ls, p = local_shape(m, lay, a), local_params(m, lay, a)
    kv = kv_block_bytes(ls.tokens, ls.kv_heads, m.head_dim, a.act_bytes)
    out = {
        "tp": tp_bytes(m, lay, ls, a),
        "cp": m.layers * ring_bytes_per_layer(kv, lay.cp, passes(a), a.act_bytes, a.acc_bytes),
        "cp_allgather": m.layers * allgather_bytes_per_layer(kv, lay.cp, passes(a), a.act_bytes, a.acc_bytes),
        "fsdp": fsdp_bytes(m, lay, p, a),
        "ep": ep_bytes(m, lay, ls, a),
        "dp": dp_bytes(m, lay, p, a),
    }
    out["total"] = sum(v for k, v in out.items() if k != "cp_allgather")
    return out


# -- time, as an order of magnitude --------------------------------------------------------


def step_flops(m: ModelShape, lay: Layout, a: Assumptions) -> float:
    """FLOPs one rank computes per step. Matmuls: ``2 x tokens`` per weight used per
    pass, over the forward, the recompute and a backward of two passes (the head too: the
    chunked loss recomputes it), with ``top_k`` of the experts per token. Attention:
    causal, a rank's queries see ``S / 2`` keys on average (zigzag balances it), ``4 x
    tokens x S / 2 x local heads x head_dim`` per forward, the backward 2.5 forwards."""
    ls, p = local_shape(m, lay, a), local_params(m, lay, a)
    forwards = passes(a)
    per_token = m.layers * (p.layer_dense + m.top_k * 3 * m.hidden * ls.expert_mlp) + p.head
    matmul = 2 * ls.tokens * per_token * (forwards + 2)
    attn_fwd = 4 * ls.tokens * (a.seq / 2) * ls.heads * m.head_dim
    return matmul + m.layers * attn_fwd * (forwards + 2.5)


def link_gbps(lay: Layout, axis: str, a: Assumptions) -> float:
    """The bandwidth an axis's group gets: inside a node when its span fits one."""
    return a.intra_gbps if lay.span(axis) <= a.node else a.inter_gbps


AXIS_OF = {"tp": "tp", "cp": "cp", "cp_allgather": "cp", "fsdp": "fsdp", "ep": "ep", "dp": "dp_replicate"}


def seconds(m: ModelShape, lay: Layout, a: Assumptions, sent: dict[str, float]) -> dict[str, float]:
    """Compute seconds (FLOPs / throughput) and, per axis, bytes / its link's bandwidth.
    Says nothing of overlap: see :func:`ring_hiding_tokens`."""
    out = {"compute": step_flops(m, lay, a) / (a.tflops * 1e12)}
    for key, axis in AXIS_OF.items():
        out[key] = sent[key] / (link_gbps(lay, axis, a) * GB)
    return out


def ring_hiding_tokens(m: ModelShape, gbps: float, a: Assumptions) -> float:
    """The shortest ``S / cp`` at which one ring step's transfer takes no longer than its
    compute, in the backward (the harder pass). A zigzag step computes ``tokens^2 / 2``
    query-key pairs: ``2.5 x 4 x tokens^2 / 2 x heads x head_dim`` FLOPs per local head
    count, and sends one K/V block and one float32 dK/dV block: ``2 x tokens x kv_heads x
    head_dim x (act + acc)`` bytes. Equal when ``tokens = 2 (act + acc) F / (5 g B)``, with
    ``g`` the GQA group (query heads per K/V head), independent of TP."""
    return 2 * (a.act_bytes + a.acc_bytes) * a.tflops * 1e12 / (5 * m.gqa_group * gbps * GB)


# -- layouts, models, output ---------------------------------------------------------------

_AXIS_NAMES = {"tp": "tp", "cp": "cp", "dp": "dp_shard", "rep": "dp_replicate", "ep": "ep"}


def parse_layout(text: str) -> Layout:
    """``"dp2xtp8xcp4"`` -> Layout: ``tp``, ``cp``, ``dp`` (FSDP's dp_shard), ``rep``
    (dp_replicate), ``ep``, each followed by its size, joined by ``x``."""
    sizes: dict[str, int] = {}
    for part in text.lower().split("x"):
        match = re.fullmatch(r"(tp|cp|dp|rep|ep)(\d+)", part)
        if not match or _AXIS_NAMES[match[1]] in sizes:
            raise ValueError(f"layout {text!r}: write axes as tp4, cp2, dp2 (FSDP), rep2 (replicas), ep8, each once, "
                             "joined by 'x' (e.g. dp2xtp8xcp4)")
        sizes[_AXIS_NAMES[match[1]]] = int(match[2])
    return Layout(text, **sizes)


MODELS = {
    "llama3_8b": ModelShape("Llama-3-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336,
                            vocab=128256),
    "qwen3_30b_a3b": ModelShape("Qwen3-30B-A3B (MoE)", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                                mlp=0, vocab=151936, experts=128, top_k=8, expert_mlp=768, qk_norm=True),
}
DENSE_LAYOUTS = ("cp8", "tp2xcp4", "tp4xcp2", "tp8", "dp2xcp4", "tp8xcp8", "dp2xtp8xcp4", "rep8xcp8", "cp64")
MOE_LAYOUTS = ("cp8", "tp2xcp4", "tp4xcp2", "tp8", "dp2xcp4", "ep8xcp8", "ep4xcp4xdp2",
               "tp8xcp8", "dp8xcp8xep8", "rep8xcp8xep8")
DEFAULT_LAYOUTS = {"llama3_8b": DENSE_LAYOUTS, "qwen3_30b_a3b": MOE_LAYOUTS}


@dataclass
class Row:
    """One model x layout: everything printed, in bytes and seconds."""

    model: str
    layout: str
    world: int
    tokens_per_rank: int
    memory_bytes: dict[str, float]
    sent_bytes: dict[str, float]
    seconds: dict[str, float]
    links: dict[str, str]
    notes: list[str] = field(default_factory=list)


def evaluate(m: ModelShape, lay: Layout, a: Assumptions) -> Row:
    """Every figure of one model under one layout."""
    sent = communication(m, lay, a)
    notes = []
    if lay.tp > m.kv_heads:
        notes.append(f"tp {lay.tp} > {m.kv_heads} K/V heads: K/V heads replicated")
    links = {axis: ("node" if lay.span(axis) <= a.node else "cross")
             for axis in ("tp", "cp", "fsdp", "ep", "dp_replicate")}
    return Row(m.name, lay.name, lay.world, local_shape(m, lay, a).tokens, memory(m, lay, a), sent,
               seconds(m, lay, a, sent), links, notes)


MEMORY_COLUMNS = ("state", "gathered", "checkpoints", "attention", "mlp", "ring", "loss", "peak")
SENT_COLUMNS = ("tp", "cp", "fsdp", "ep", "dp", "total", "cp_allgather")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _fmt(x: float, scale: float) -> str:
    return "-" if x == 0 else f"{x / scale:.2f}"


def render(m: ModelShape, rows: list[Row], a: Assumptions) -> str:
    """The three tables of one model, in Markdown."""
    params = total_params(m)
    out = [f"### {m.name}: {params / 1e9:.2f}B parameters, S = {a.seq:,} tokens", "",
           "GiB per rank (`peak` = state + gathered + checkpoints + max(loss, one layer's working set)):", ""]
    out.append(_table(["layout", "GPUs", "S/cp", *MEMORY_COLUMNS],
                      [[r.layout, str(r.world), f"{r.tokens_per_rank:,}", *(_fmt(r.memory_bytes[c], GiB)
                                                                           for c in MEMORY_COLUMNS)] for r in rows]))
    out += ["", "GB sent per rank per step, by axis (`cp_allgather`: the all-gather pattern instead of the ring, "
            "not in the total):", ""]
    out.append(_table(["layout", *SENT_COLUMNS],
                      [[r.layout, *(_fmt(r.sent_bytes[c], GB) for c in SENT_COLUMNS)] for r in rows]))
    out += ["", f"Seconds per step at {a.tflops:g} TFLOP/s and {a.intra_gbps:g} GB/s inside a node of {a.node}, "
            f"{a.inter_gbps:g} GB/s across (no overlap assumed; `x` marks a group that crosses nodes):", ""]
    keys = ("tp", "cp", "fsdp", "ep", "dp")

    def cell(r: Row, k: str) -> str:
        s = r.seconds[k]
        return "-" if s == 0 else f"{s:.3f}" + (" x" if r.links[AXIS_OF[k]] == "cross" else "")
    out.append(_table(["layout", "compute", *keys],
                      [[r.layout, f"{r.seconds['compute']:.2f}", *(cell(r, k) for k in keys)] for r in rows]))
    notes = [f"{r.layout}: {n}" for r in rows for n in r.notes]
    hide = {where: ring_hiding_tokens(m, g, a) for where, g in (("node", a.intra_gbps), ("cross", a.inter_gbps))}
    out += ["", f"The ring's backward step hides its transfer from S/cp >= {hide['node']:,.0f} tokens inside a node, "
            f">= {hide['cross']:,.0f} across nodes (GQA group {m.gqa_group})."]
    if notes:
        out += ["", "Notes: " + "; ".join(notes) + "."]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--layouts", nargs="+", help="e.g. cp8 tp2xcp4 dp2xtp8xcp4 ep8xcp8 (default: the doc's)")
    p.add_argument("--seq", type=int, default=Assumptions.seq)
    p.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations (no recompute)")
    p.add_argument("--node", type=int, default=Assumptions.node, help="GPUs per node")
    p.add_argument("--intra-gbps", type=float, default=Assumptions.intra_gbps)
    p.add_argument("--inter-gbps", type=float, default=Assumptions.inter_gbps)
    p.add_argument("--tflops", type=float, default=Assumptions.tflops)
    p.add_argument("--json", action="store_true", help="one JSON object: assumptions and every row")
    args = p.parse_args(argv)
    try:
        a = Assumptions(seq=args.seq, checkpointing=not args.no_checkpointing, node=args.node,
                        intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps, tflops=args.tflops)
        results = {key: [evaluate(MODELS[key], parse_layout(t), a) for t in (args.layouts or DEFAULT_LAYOUTS[key])]
                   for key in args.model}
    except ValueError as e:
        p.error(str(e))
    if args.json:
        print(json.dumps({"assumptions": asdict(a),
                          "models": {k: {**asdict(MODELS[k]), "params": total_params(MODELS[k])} for k in results},
                          "rows": [asdict(r) for rows in results.values() for r in rows]}, indent=1))
    else:
        print("\n\n".join(render(MODELS[k], rows, a) for k, rows in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
