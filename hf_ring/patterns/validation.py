"""Checks run before any point-to-point transfer, so that a mistake is an error on every
rank instead of a hang.

Local checks (:func:`check_local`) need no communication and no host sync: they read
shapes, dtypes and settings only. The cross-rank check (:func:`check_agreement`) gathers
a fixed-length vector of named integers from every rank of the group (one small
all-gather and one host sync) and raises the same error on all ranks when any value
differs: mismatched ring messages would otherwise block forever or corrupt memory. Its
length never depends on the inputs, so ranks holding different shapes get an error, not
a gloo abort or an NCCL hang.

Who runs it: the public ring ops once per call (unless the caller says it validated
already), and the Hugging Face integration once per model forward
(``hf_ring.hf.cp_inputs``), after which the attention layers of that forward run without
any check across ranks.
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hf_ring.distributed.nccl_failures import watch_all
from hf_ring.sharding.layouts import LAYOUTS, check_layout

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def inputs_digest(tensors: Sequence[Optional[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """0-d int64 on ``device``: a position-weighted sum of ``tensors`` (None entries skipped,
    floating ones read by their bits), equal on every rank that holds the same inputs; no
    host sync. Ranks feeding one forward the same full batch (a multimodal model's, a prompt
    to generate from) compare it with :func:`check_agreement`."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            if t.is_floating_point():
                t = t.contiguous().view(_BITS[t.element_size()])
            flat = t.reshape(-1).to(device=device, dtype=torch.int64)
            weights = torch.arange(flat.numel(), device=device) % 65521 + 2 * i + 1
            total = total * 1000003 + (flat * weights).sum() + flat.numel()
    return total


def check_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, causal: bool) -> None:
    """Shapes, dtypes and layout of this rank's q ``(b, s, hq, d)``, k ``(b, s, hk, d)`` and
    v ``(b, s, hk, dv)`` (``dv`` may differ from ``d``: multi-head latent attention)."""
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be (batch, local_seq, heads, head_dim) (flash-attn layout), got "
                f"shape {tuple(t.shape)}; transformers' (batch, heads, seq, dim) tensors need "
                ".transpose(1, 2)"
            )
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; ring attention takes {[str(d) for d in _DTYPES]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        # The head sizes may differ (multi-head latent attention: v heads narrower than q/k).
        raise ValueError(f"k and v must agree on batch, local_seq and n_kv_heads, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, local_seq and "
            "head_dim: every rank holds the same tokens of q, k and v"
        )
    if hq % k.shape[2] != 0:
        raise ValueError(
            f"n_heads={hq} is not a multiple of n_kv_heads={k.shape[2]}; grouped-query "
            "attention needs every KV head to serve the same number of query heads"
        )
    if s == 0:
        raise ValueError("local_seq is 0: every rank must hold at least one token")
    if causal and layout == "zigzag" and s % 2 != 0:
        raise ValueError(
            f"local_seq={s} is odd, but a zigzag shard is two equal chunks; pad the full "
            "sequence to a multiple of 2 * cp_size before sharding"
        )


def float_bits(x: float) -> int:
    """A float as the int64 of its IEEE bits: exact equality across ranks, no rounding."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(n)))[0]


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """A float dtype as an int for :func:`check_agreement` (-1: none or another dtype)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _shown(name: str, value: int):
    """A field's value as the error shows it: scales as floats, dtypes by name."""
    if name.endswith("_scale"):
        return _bits_float(value)
    if name.endswith("dtype"):
        return str(_DTYPES[value]).removeprefix("torch.") if 0 <= value < len(_DTYPES) else "other"
    return value


def name_code(name: str) -> int:
    """A name (a kernel's) as an agreement field: a checksum that is the same in every
    process (Python's ``hash`` of a str is not)."""
    return zlib.crc32(str(name).encode())


_HASH_PRIME = (1 << 61) - 1  # a Mersenne prime: a polynomial hash over it rarely collides


def int_hash(values: Sequence[int]) -> int:
    """An order-sensitive polynomial hash of ``values`` as one agreement field (a weighted
    sum would collide on simple reorderings, e.g. of document lengths)."""
    digest = 0
    for x in values:
        digest = (digest * 1_000_003 + int(x) + 1) % _HASH_PRIME
    return digest


def layout_code(layout: str) -> int:
    return LAYOUTS.index(layout) if layout in LAYOUTS else -1


def check_agreement(
    group: Optional[dist.ProcessGroup],
    fields: Sequence[tuple[str, int]],
    device: torch.device,
    what: str,
    hint: str,
    ignore: Sequence[str] = (),
    values: Optional[torch.Tensor] = None,
) -> list[list[int]]:
    """All-gather ``fields`` (name, int) from every rank of ``group``; raise the same
    ValueError on every rank if any value differs. Collective: every rank must call it with
    the same field names (its length is fixed by the names, never by the inputs).

    Args:
        group: the process group (None: the default group).
        fields: ``[(name, value)]``; a name ending in ``"_scale"`` holds :func:`float_bits`,
            one ending in ``"dtype"`` a :func:`dtype_code`.
        device: where the gathered tensor lives (the group's backend device).
        what: what must agree, for the error ("ring attention inputs").
        hint: what to do, for the error.
        ignore: names whose values may differ (the caller reads them from the result).
        values: the values as an int64 tensor on ``device``, when some were computed there
            (no host sync before the collective); default: built from ``fields``.

    Returns:
        Every rank's values, in rank order (identical but for ``ignore`` when it returns).
    """
    world = dist.get_world_size(group)
    mine = values if values is not None else torch.tensor([v for _, v in fields], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    watch_all(work, group, "the check of a forward's inputs")  # NCCL: a stalled check is reported by name
    work.wait()
    rows = torch.stack(gathered).tolist()
    diffs = []
    for i, (name, _) in enumerate(fields):
        if name in ignore:
            continue
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = [_shown(name, x) for x in values]
            diffs.append(f"{name}: " + ", ".join(f"rank {r} {x}" for r, x in enumerate(shown)))
    if diffs:
        raise ValueError(f"{what} differ across the ranks of the context-parallel group ({'; '.join(diffs)}); {hint}")
    return rows


def _tensor_fields(name: str, t: torch.Tensor) -> list[tuple[str, int]]:
    shape = list(t.shape)[:4] + [-1] * (4 - min(t.dim(), 4))
    return [(f"{name}.dim", t.dim()), *((f"{name}.shape[{i}]", n) for i, n in enumerate(shape)),
            (f"{name}.dtype", dtype_code(t.dtype))]


def check_across_ranks(
    group: Optional[dist.ProcessGroup],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    causal: bool,
    scale: float,
    extra: Sequence[tuple[str, int]] = (),
) -> None:
    """Raise (on every rank) unless every rank passes the same shapes, dtypes, layout,
    mask and softmax scale (and ``extra``, e.g. the packed row's documents).

    Runs before the local checks: once every rank is known to hold the same shapes and
    settings, the local checks (pure functions of those) pass or fail on all ranks alike,
    so no rank is left waiting in a transfer that a failed rank never starts.
    """
    fields = [
        *_tensor_fields("q", q), *_tensor_fields("k", k), *_tensor_fields("v", v),
        ("layout", layout_code(layout)), ("causal", int(causal)), ("softmax_scale", float_bits(scale)),
        *extra,
    ]
    check_agreement(
        group, fields, q.device, "ring attention inputs",
        "every rank must pass the same shapes, dtype and settings (shard the full, padded "
        "sequence with shard_sequence / RingDataCollator)",
    )
