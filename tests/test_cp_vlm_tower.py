"""The vision tower split over the CP group (``hf_ring.hf.multimodal.tower``), transformers 5.x.

What ``tests/test_cp_vlm.py`` proves for the Qwen families (logits and every gradient, the
tower's included, as one process) holds with the split on: it is on there. This file checks
that the split is what runs: on a world of 2, each rank's tower encodes only its share of a
call's images (its patch embedding sees only those patch rows, and the shares cover the
call once); a call with fewer images than ranks (a single video) runs whole on both ranks;
the tower's hidden states, asked for, come back whole (equal to one process's within 1e-5:
float32, the same per-image computation, measured ~1e-7); ranks given different images
are refused on every rank before any feature is gathered. And the plan itself: shares
balanced by patch count, one entry at least each, whole when there are fewer entries
than ranks.
"""

from __future__ import annotations

import pytest
import torch

import hf_ring
from distributed import run_world
from hf_ring.hf.multimodal.tower import plan_split
from hf_ring.patches.transformers import release_line
from closeness import rel_err
from vlm_cases import FAMILIES, build
from vlm_checks import WORLD


def test_plan_balances_patches_and_gives_every_rank_an_entry():
    entries, patches, rows = plan_split([[1, 4, 8], [1, 4, 4], [1, 4, 8], [1, 4, 4]], 2, 2)
    assert entries == ((0, 2), (2, 4)) and patches == ((0, 48), (48, 96)) and rows == ((0, 12), (12, 24))
    # One large entry first: the others still get one each, in order.
    entries, _, _ = plan_split([[8, 16, 16], [1, 2, 2], [1, 2, 2]], 3, 2)
    assert entries == ((0, 1), (1, 2), (2, 3))
    assert plan_split([[2, 4, 4]], 2, 2) is None


def _rank_main(rank: int, world: int, config, state_dict, batch, other) -> dict:
    hf_ring.setup_context_parallel(world)
    model = build(config, "ring_flash", state_dict)
    seen: list[int] = []
    model.model.visual.patch_embed.register_forward_hook(lambda m, a, out: seen.append(a[0].shape[0]))
    with torch.no_grad():
        images = model(**batch, output_hidden_states=True).image_outputs
        model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])  # outside a CP forward
    try:
        model(**(other if rank == 1 else batch))
        refusal = "no error"
    except ValueError as e:
        refusal = str(e)
    return {"seen": seen, "hidden": images.hidden_states, "pooled": torch.cat(images.pooler_output),
            "last": images.last_hidden_state, "refusal": refusal}


@pytest.mark.skipif(release_line(__import__("transformers").__version__) != "5",
                    reason="the multimodal families were read and tested on transformers 5.x")
def test_each_rank_encodes_its_share_of_the_images():
    config_of, batch_of = FAMILIES["qwen2_5_vl"]
    config = config_of()
    reference = build(config, "sdpa")
    batch = batch_of(0)  # images of 32 and 16 patches (one call), a video of 32 (another)
    other = dict(batch, pixel_values=batch["pixel_values"].flip(0))  # rank 1's images differ
    ranks = run_world(WORLD, _rank_main, config, reference.state_dict(), batch, other)
    # Forward of the model: the image call split (32 | 16), the video call whole (32 on both);
    # then get_image_features alone, outside the model's forward: whole on both ranks.
    assert ranks[0]["seen"][:2] == [32, 32] and ranks[1]["seen"][:2] == [16, 32], [r["seen"] for r in ranks]
    assert ranks[0]["seen"][2] == ranks[1]["seen"][2] == 48
    with torch.no_grad():
        images = reference.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"],
                                                    output_hidden_states=True)
    for r in ranks:
        assert r["last"] is None  # the pre-merge patches: left out rather than a share
        assert len(r["hidden"]) == len(images.hidden_states)
        assert rel_err(r["pooled"], torch.cat(images.pooler_output)) <= 1e-5
        assert all(rel_err(h, ref) <= 1e-5 for h, ref in zip(r["hidden"], images.hidden_states))
        assert "full_batch_digest" in r["refusal"], r["refusal"]


def test_a_packed_row_without_cp_runs_the_tower_whole():
    """A packed row without CP reaches the tower with a FullBatch whose state is None (only its
    spans go down): the tower is not split, and nothing reads a CP size from a missing state."""
    from hf_ring.hf.multimodal.shard import CURRENT, FullBatch
    from hf_ring.hf.multimodal.tower import _take_share

    token = CURRENT.set(FullBatch(family=None, state=None, digest=None))
    try:
        assert _take_share(torch.nn.Identity(), (), {}) is None
    finally:
        CURRENT.reset(token)
