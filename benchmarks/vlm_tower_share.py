"""The vision tower's share of a training step under context parallelism (issue 21).

Under CP every rank of a group holds the same full batch, and the language model's work
falls as ``1 / cp_size`` (each rank runs its shard of the tokens). The vision tower is
different: run on every rank ("replicated", what hf_ring does today), its work does not
fall at all; split over the group, each rank encoding its share of the images and the
features all-gathered, it falls as ``1 / cp_size`` too. This script says how much of a
step's time that is, for published checkpoints' shapes at 8k, 32k and 128k tokens.

**Modelled, not measured on a GPU**: time is taken as proportional to floating-point work
(forward + backward = 3 x forward; a frozen tower runs forward only), counted from the
shapes below. That ignores the kernels' different efficiencies (the tower's short
windowed attention runs below the language model's matmul rate, so the tower's real share
is if anything higher) and the ring's communication (hidden behind compute at these
lengths, docs/performance.md). ``--check`` runs tiny models here and compares the formula
with PyTorch's own FLOP counter (``torch.utils.flop_counter``) on the same inputs, tower and
language model separately.

Shapes: Qwen2.5-VL-7B (the published checkpoint's module tree: a 32-block ViT of width
1280, gated MLP 3420, windows of 112 px with full attention in blocks 7/15/23/31, 2 x 2
merge into 3584; a 28-layer decoder of width 3584, 4 KV heads of 128, MLP 18944, vocab
152064) and Qwen3-VL-8B (a 27-block ViT of width 1152, MLP 4304, full attention, patch 16;
a 36-layer decoder of width 4096, 8 KV heads of 128, MLP 12288, vocab 151936).
Workloads: a video at 448 x 448 (Qwen2.5-VL: 256 tokens per two frames) or many document
pages at 1344 x 1344 (2304 tokens a page), 90 % of the tokens visual, the rest text.

    python benchmarks/vlm_tower_share.py            # the table
    python benchmarks/vlm_tower_share.py --check    # the formula against torch's FLOP counter
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Optional

CP_SIZES = (1, 2, 4, 8, 16)
LENGTHS = (8192, 32768, 131072)
VISUAL_SHARE = 0.9


@dataclass(frozen=True)
class Tower:
    """A Qwen-style ViT: patches of ``patch`` px (``temporal`` frames deep), ``merge`` x
    ``merge`` patches merged into one token of width ``out``."""

    depth: int
    width: int
    mlp: int
    gated: bool
    patch: int
    merge: int = 2
    temporal: int = 2
    window: Optional[int] = None  # window side in px for the windowed blocks (None: all full)
    full_blocks: int = 0  # blocks with full attention when windowed
    out: int = 3584
    extra_mergers: int = 0  # Qwen3-VL's deepstack mergers, one per fed decoder layer

    def forward_flops(self, grids: list[tuple[int, int, int]]) -> float:
        """Forward FLOPs over images / videos of ``(t, h, w)`` patches each."""
        total = 0.0
        for t, h, w in grids:
            p = t * h * w
            total += 2 * p * (3 * self.temporal * self.patch**2) * self.width  # patch embedding
            mlp_mats = 3 if self.gated else 2
            dense = 2 * p * self.width * (4 * self.width) + mlp_mats * 2 * p * self.width * self.mlp
            # Attention spans one frame's patches (cu_seqlens per temporal patch), or a window of them.
            frame = h * w
            windowed = min(frame, (self.window // self.patch) ** 2) if self.window else frame
            n_full = self.full_blocks if self.window else self.depth
            attn_full = 4 * p * frame * self.width
            attn_window = 4 * p * windowed * self.width
            total += self.depth * dense + n_full * attn_full + (self.depth - n_full) * attn_window
            m = self.merge**2
            merger = 2 * (p / m) * (m * self.width) ** 2 + 2 * (p / m) * (m * self.width) * self.out
            total += (1 + self.extra_mergers) * merger
        return total


@dataclass(frozen=True)
class Text:
    """A decoder: ``layers`` of width ``width``, K/V of width ``kv`` each, MLP ``mlp`` (gated)."""

    layers: int
    width: int
    kv: int
    mlp: int
    vocab: int

    def forward_flops(self, tokens: int, causal_kernel: bool = True) -> float:
        """Forward FLOPs over one causal row of ``tokens`` tokens (LM head included); with
        ``causal_kernel`` False, attention over the whole square (what eager attention computes
        before masking), else over the causal half (what flash kernels compute)."""
        dense = 2 * tokens * self.width * (2 * self.width + 2 * self.kv) + 3 * 2 * tokens * self.width * self.mlp
        keys = (tokens + 1) / 2 if causal_kernel else tokens
        attn = 4 * self.width * tokens * keys  # QK^T and AV
        return self.layers * (dense + attn) + 2 * tokens * self.width * self.vocab


MODELS = {
    "qwen2_5_vl_7b": (
        Tower(depth=32, width=1280, mlp=3420, gated=True, patch=14, window=112, full_blocks=4, out=3584),
        Text(layers=28, width=3584, kv=512, mlp=18944, vocab=152064),
    ),
    "qwen3_vl_8b": (
        Tower(depth=27, width=1152, mlp=4304, gated=False, patch=16, out=4096, extra_mergers=3),
        Text(layers=36, width=4096, kv=1024, mlp=12288, vocab=151936),
    ),
}
# Workloads: (frame side in px, frames per grid entry) -> grids for a number of visual tokens.
WORKLOADS = {"video_448": 448, "pages_1344": 1344}


def grids_for(tower: Tower, side_px: int, visual_tokens: int, video: bool) -> list[tuple[int, int, int]]:
    """Grids ``(t, h, w)`` in patches holding about ``visual_tokens`` merged tokens: one video
    of frames ``side_px`` square, or that many ``side_px`` pages (one temporal patch each)."""
    side = side_px // tower.patch
    per_entry = side * side // tower.merge**2
    n = max(1, round(visual_tokens / per_entry))
    return [(n, side, side)] if video else [(1, side, side)] * n


def step_shares(model: str, workload: str, tokens: int, tower_trained: bool = True) -> dict:
    """Per-rank step work and the tower's share, replicated and split, at every CP size."""
    tower, text = MODELS[model]
    grids = grids_for(tower, WORKLOADS[workload], int(VISUAL_SHARE * tokens), video=workload.startswith("video"))
    t_tower = tower.forward_flops(grids) * (3 if tower_trained else 1)
    t_text = 3 * text.forward_flops(tokens)
    rows = []
    for cp in CP_SIZES:
        text_rank = t_text / cp
        rows.append({
            "cp_size": cp,
            "tower_share_replicated": t_tower / (t_tower + text_rank),
            "tower_share_split": (t_tower / cp) / (t_tower / cp + text_rank),
            "step_speedup_of_split": (t_tower + text_rank) / (t_tower / cp + text_rank),
        })
    return {"model": model, "workload": workload, "tokens": tokens, "tower_trained": tower_trained,
            "tower_tflop": t_tower / 1e12, "text_tflop": t_text / 1e12, "rows": rows}


def check(seq: int = 256) -> list[dict]:
    """The formula against ``torch.utils.flop_counter.FlopCounterMode`` on tiny Qwen2.5-VL and
    Qwen3-VL models (eager attention, so every matmul is counted), forward only."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, vocab_size=256, max_position_embeddings=4096)
    tokens = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    cases = {
        "qwen2_5_vl": (
            Qwen2_5_VLConfig(text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
                             vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                                                out_hidden_size=64, window_size=16, fullatt_block_indexes=[3]), **tokens),
            Qwen2_5_VLForConditionalGeneration,
            Tower(depth=4, width=32, mlp=48, gated=True, patch=4, window=16, full_blocks=1, out=64),
        ),
        "qwen3_vl": (
            Qwen3VLConfig(text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}),
                          vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                                             out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[1]), **tokens),
            Qwen3VLForConditionalGeneration,
            Tower(depth=3, width=32, mlp=48, gated=False, patch=4, out=64, extra_mergers=1),
        ),
    }
    out = []
    for name, (config, cls, tower) in cases.items():
        config._attn_implementation = "eager"
        config.text_config._attn_implementation = "eager"
        config.vision_config._attn_implementation = "eager"
        model = cls(config).eval()
        grid = (2, 16, 16)  # a video of 4 frames, 2 temporal patches of 16 x 16 patches
        n_visual = math.prod(grid) // 4
        pixels = torch.randn(math.prod(grid), 3 * 2 * 4 * 4)
        grid_t = torch.tensor([grid])
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.model.visual(pixels, grid_thw=grid_t)
        counted_tower = counter.get_total_flops()
        t = Text(layers=2, width=64, kv=32, mlp=128, vocab=256)
        ids = torch.randint(0, 200, (1, seq + n_visual))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.model.language_model(input_ids=ids)
            model.lm_head(torch.zeros(1, ids.shape[1], 64))
        counted_text = counter.get_total_flops()
        out.append({
            "model": name,
            "tower_counted": counted_tower, "tower_formula": tower.forward_flops([grid]),
            "text_counted": counted_text, "text_formula": t.forward_flops(ids.shape[1], causal_kernel=False),
        })
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare the formula with torch's FLOP counter on tiny models")
    ap.add_argument("--frozen_tower", action="store_true", help="the tower is frozen: forward only")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.check:
        result = {"check": check()}
        for r in result["check"]:
            print(f"{r['model']}: tower formula / counted = {r['tower_formula'] / r['tower_counted']:.4f}, "
                  f"language model formula / counted = {r['text_formula'] / r['text_counted']:.4f}")
    else:
        result = {"shares": [step_shares(m, w, n, not args.frozen_tower) for m in MODELS for w in WORKLOADS for n in LENGTHS]}
        print(f"vision tower's share of a step's work per rank ({'frozen' if args.frozen_tower else 'trained'} tower; "
              "modelled from FLOPs): replicated / split over the CP group")
        print(f"{'model':15} {'workload':11} {'tokens':>7}  " + "  ".join(f"cp={c:<2}        " for c in CP_SIZES))
        for s in result["shares"]:
            cells = "  ".join(f"{r['tower_share_replicated']:.2f} / {r['tower_share_split']:.2f}" for r in s["rows"])
            print(f"{s['model']:15} {s['workload']:11} {s['tokens']:>7}  {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
