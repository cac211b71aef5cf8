"""The chunked LM-head loss under DDP with ``find_unused_parameters=True``, the Trainer's
default without gradient checkpointing (``ddp_find_unused_parameters=None``).

DDP then walks the autograd graph from the forward's outputs and marks every parameter it
does not reach ready at once. The chunked loss skips the head's forward and reads its
weight afterwards; when the skipped head returned a tensor unconnected to its weight, DDP
took the weight for unused and the first backward failed ("Expected to mark a variable
ready only once"), so ``RingTrainer`` at cp > 1 with default ``TrainingArguments`` crashed.
The skipped head now returns an empty output still connected to its weight in the graph.

A model with an output that no loss uses failed next, at the second step ("Expected to have
finished reduction in the prior iteration"): LLaVA returns its vision tower's outputs, whose
``last_hidden_state`` comes from the tower's last layer, which LLaVA's feature layer (-2)
does not read. DDP routes the outputs through a sink whose backward hands the unused ones an
undefined gradient, and its reducer takes that as those parameters' turn; the chunked loss,
computed from the captured hidden states, bypassed the sink, so the last layer stayed
pending. The chunked loss now also reaches the outputs' (empty) logits, adding exactly 0.

Checked in a gloo world of 2 (one CP group): two backward passes of a tiny Llama, and of a
tiny LLaVA (tests/vlm_cases.py: a CLIP tower of 2 layers, its last one unused), wrapped in
DDP(find_unused_parameters=True), the chunked loss against the full logits' loss: every
gradient within 1e-6 relative (float32; the same token losses, summed by chunks of 8 rows:
measured ~2.5e-7; relative to at least 1e-3 of the largest gradient's norm, since the tower's
k_proj bias has a gradient of exactly zero whose rounding noise, ~4e-10, differs between the two
sums), and the tower's last layer without a gradient on both sides. The LLaVA case
failed at its second step before the fix.
"""

from __future__ import annotations


import pytest
import torch

import eval_loss_run
from distributed import run_world
from closeness import rel_err


def _llama(rank: int, world: int) -> tuple:
    import hf_ring

    collate = hf_ring.RingDataCollator(eval_loss_run.PAD, cp_size=world, cp_rank=rank)
    batch = collate(eval_loss_run.eval_rows()[:2])
    shift_labels = batch.pop("shift_labels")
    batch.pop("labels")
    return lambda: eval_loss_run.tiny_llama("ring_flash"), batch, shift_labels


def _llava(rank: int, world: int) -> tuple:
    """Its rows' labels: the ids shifted on the full row, image placeholders -100, then sharded."""
    import hf_ring
    from vlm_cases import FAMILIES, IMAGE, build

    config, make_batch = FAMILIES["llava"]
    batch = make_batch(0)
    labels = batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, -100)
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    shift_labels = hf_ring.shard_sequence(shifted, world, rank)
    return lambda: build(config(), "ring_flash"), dict(batch, use_cache=False), shift_labels


def _rank(rank: int, world: int, case: str) -> dict:
    import hf_ring
    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
    from hf_ring.training.loss import token_loss_sum

    hf_ring.setup_context_parallel(world)
    make_model, batch, shift_labels = {"llama": _llama, "llava": _llava}[case](rank, world)
    grads = {}
    for chunked in (True, False):
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        for _ in range(2):
            ddp.zero_grad()
            if chunked:
                loss, _ = model_token_loss_sum(ddp, model, batch, shift_labels, ChunkedLossConfig(True, chunk_tokens=8))
            else:
                loss = token_loss_sum(ddp(**batch).logits, shift_labels)
            loss.backward()
        grads[chunked] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads


@pytest.mark.parametrize("case", ("llama", "llava"))
def test_chunked_loss_under_ddp_that_finds_unused_parameters(case):
    for grads in run_world(2, _rank, case):
        assert set(grads[True]) == set(grads[False])
        unused = [n for n in grads[False] if "vision_tower.encoder.layers.1." in n]
        assert case == "llama" or not unused, unused  # the tower's last layer: no gradient on either side
        # A gradient that is zero in exact arithmetic (the tower's k_proj bias: softmax ignores a
        # shift common to all keys) is rounding noise on both sides, ~1e-10 here, whose ratio means
        # nothing: each error is taken relative to at least 1e-3 of the largest gradient's norm.
        floor = 1e-3 * max(g.double().norm().item() for g in grads[False].values())
        worst = max(rel_err(grads[True][n], grads[False][n], floor) for n in grads[False])
        print(f"\nchunked vs full logits under DDP(find_unused_parameters=True): worst gradient {worst:.1e}")
        assert worst <= 1e-6
