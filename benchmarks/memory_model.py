"""A memory model of one training step per process: fixed bytes + bytes per token, as a
function of the model's shape and the long-context options, fitted on measured CPU runs
(long_context_memory.py), and its projection to Llama-3-8B with FSDP2 + CP on 8 GPUs.

Terms (bytes; N tokens per process, H hidden, I intermediate, L layers, V vocabulary, P
parameters; "live layers" is L, or 1 when every layer is checkpointed: only the layer being
recomputed holds its activations):

    a_H * N * H * live_layers              attention, norms, residuals saved by the live layers
    a_I * M * I * live_layers              MLP intermediates saved; M = N, or the tile when tiled
    t_I * M * I                            one layer's MLP gradients in its backward (transient)
    b_H * N * H                            embeddings' output, final norm, head input, the
                                           hidden-sized gradients in flight
    r_H * N * H       (cp_size > 1)        the ring's K/V blocks in flight and its float32
                                           gradient accumulators
    g   * N * V       (full logits only)   logits, softmax, their gradient
    d   * C * V       (chunked loss only)  one chunk's logits and gradient (C = chunk rows)
    e   * 4 * P                            parameters, gradients, AdamW's two moments
    f0                                     the rest (allocator, autograd bookkeeping)
  + 4 * N * H * L     (checkpointing)      the checkpointed layer inputs: on a GPU with
                                           offload they are in host memory instead

a_H, a_I, t_I, b_H, r_H, g, d, e, f0 are fitted by least squares on relative error (so every point
weighs the same); the checkpointed inputs are counted, not fitted (the offload hooks report
their bytes). The fitted coefficients are float32 bytes per element-slot; for bfloat16
activations on a GPU they are halved (the "bf16" rows), or kept (the "fp32 upper bound").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OPTION_SETS: dict[str, dict[str, bool]] = {
    "none": {"chunked": False, "offload": False, "tiled": False},
    "chunked": {"chunked": True, "offload": False, "tiled": False},
    "offload": {"chunked": False, "offload": True, "tiled": False},
    "offload+tiled": {"chunked": False, "offload": True, "tiled": True},
    "chunked+offload": {"chunked": True, "offload": True, "tiled": False},
    "chunked+offload+tiled": {"chunked": True, "offload": True, "tiled": True},
}
FITTED = ("a_H", "a_I", "t_I", "b_H", "r_H", "g", "d", "e", "f0")
CHUNK_BYTES = 64 * 2**20  # hf_ring.memory.chunked_loss.DEFAULT_CHUNK_BYTES


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    @property
    def params(self) -> int:
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden


LLAMA3_8B = Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128_256)


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def features(shape: Shape, options: str, tokens: int, tile: int, cp: int = 1) -> dict[str, float]:
    """The terms of the model for one configuration, each without its coefficient."""
    o = OPTION_SETS[options]
    live = 1 if o["offload"] else shape.layers
    mlp_rows = min(tokens, tile) if o["tiled"] else tokens
    return {
        "a_H": tokens * shape.hidden * live,
        "a_I": mlp_rows * shape.intermediate * live,
        "t_I": mlp_rows * shape.intermediate,
        "b_H": tokens * shape.hidden,
        "r_H": tokens * shape.hidden if cp > 1 else 0,
        "g": 0 if o["chunked"] else tokens * shape.vocab,
        "d": min(tokens, _chunk_rows(shape.vocab)) * shape.vocab if o["chunked"] else 0,
        "e": 4 * shape.params,
        "f0": 1,
    }


def checkpointed_bytes(shape: Shape, options: str, tokens: int, bytes_per_element: int = 4) -> float:
    """The checkpointed layer inputs (counted, not fitted): offloaded to the host on a GPU."""
    return bytes_per_element * tokens * shape.hidden * shape.layers if OPTION_SETS[options]["offload"] else 0.0


def fit(points: list[dict], tile: int) -> dict[str, float]:
    """Least squares on relative error over the measured points (``peak_mb`` per process)."""
    rows, target = [], []
    for p in points:
        shape = Shape(**p["shape"])
        peak = p["peak_mb"] * 2**20
        f = features(shape, p["options"], p["tokens"], tile, p.get("cp", 1))
        rows.append([f[k] / peak for k in FITTED])
        target.append((peak - checkpointed_bytes(shape, p["options"], p["tokens"])) / peak)
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)
    return {k: float(v) for k, v in zip(FITTED, coef)}


def predict(model: dict[str, float], shape: Shape, options: str, tokens: int, tile: int, cp: int = 1) -> float:
    """Peak bytes per process as measured on CPU (checkpointed inputs included)."""
    f = features(shape, options, tokens, tile, cp)
    return sum(model[k] * f[k] for k in FITTED) + checkpointed_bytes(shape, options, tokens)


def longest_tokens(model: dict[str, float], shape: Shape, options: str, budget: float, tile: int) -> float:
    """Tokens per process at which the predicted peak reaches ``budget`` bytes (the model is
    affine in tokens above the tile and the chunk, which the answer exceeds)."""
    big = 1 << 22
    at0 = predict(model, shape, options, big, tile)
    slope = (predict(model, shape, options, 2 * big, tile) - at0) / big
    return max(0.0, (budget - (at0 - slope * big)) / slope)


# ---- projection: Llama-3-8B, FSDP2 + CP over 8 GPUs ----

GPUS = 8
RESERVE_GB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation (assumed)
HOST_GB_PER_GPU = 250.0  # 2 TB of host memory per 8-GPU node (DGX H100 / H200)


def _root_unsharded_bytes(shape: Shape, options: str) -> float:
    """What FSDP2's root unit holds whole from its forward to its post-backward reduce-scatter
    (the decoder layers are their own units; the root is never resharded after forward): the
    embeddings' and the head's bf16 weights and gradients (untied, as Llama-3-8B), plus with
    the chunked loss its float32 accumulator of the head's gradient during the loss's backward
    (hf_ring.memory.chunked_loss, which runs inside the head's call on that unsharded weight)."""
    matrix = shape.vocab * shape.hidden
    chunked_accumulator = 4 * matrix if OPTION_SETS[options]["chunked"] else 0
    return 2 * (2 * matrix * 2) + chunked_accumulator


def _device_bytes(model: dict[str, float], shape: Shape, options: str, tokens: int, tile: int, act_scale: float) -> float:
    """Bytes on one GPU holding ``tokens`` tokens, bf16 weights and activations (``act_scale``
    0.5 of the fitted float32 activation terms, or 1.0 for an upper bound), FSDP2 over GPUS."""
    f = features(shape, options, tokens, tile, cp=GPUS)
    activations = sum(model[k] * f[k] for k in ("a_H", "a_I", "t_I", "b_H", "r_H")) * act_scale
    logits = model["g"] * f["g"] + model["d"] * f["d"]  # the loss upcasts logits to float32
    layer_params = (shape.params - shape.vocab * shape.hidden * 2) / shape.layers
    sharded_states = 16 * shape.params / GPUS  # fp32 master weights, fp32 grads, AdamW m and v
    unsharded = 2 * (2 * layer_params * 2) + _root_unsharded_bytes(shape, options)
    # With offload the checkpointed inputs are in host memory; without, nothing is checkpointed.
    return activations + logits + sharded_states + unsharded + RESERVE_GB * 1e9


def project(model: dict[str, float], shape: Shape, tile: int) -> list[dict]:
    """The longest context (tokens per GPU x GPUS) that fits 80 GB and 141 GB GPUs."""
    rows = []
    for gpu_gb in (80, 141):
        for options in ("none", "chunked", "chunked+offload", "chunked+offload+tiled"):
            for dtype, scale in (("bf16", 0.5), ("fp32-ub", 1.0)):
                lo, hi = 0, 1 << 26
                while hi - lo > 64:  # the largest token count that fits (memory grows with tokens)
                    mid = (lo + hi) // 2
                    fits = _device_bytes(model, shape, options, mid, tile, scale) <= gpu_gb * 1e9
                    lo, hi = (mid, hi) if fits else (lo, mid)
                host = checkpointed_bytes(shape, options, lo, bytes_per_element=2)
                per_token_host = checkpointed_bytes(shape, options, 1, bytes_per_element=2)
                host_limit = int(HOST_GB_PER_GPU * 1e9 / per_token_host) if per_token_host else lo
                rows.append({"gpu_gb": gpu_gb, "options": options, "activation_dtype": dtype,
                             "tokens_per_gpu": lo, "longest_context": lo * GPUS, "host_gb_per_gpu": host / 1e9,
                             "longest_context_2tb_host": min(lo, host_limit) * GPUS})
    return rows
