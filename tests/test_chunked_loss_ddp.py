"""The chunked LM-head loss under DDP with ``find_unused_parameters=True``, the Trainer's
default without gradient checkpointing (``ddp_find_unused_parameters=None``).

DDP then walks the autograd graph from the forward's outputs and marks every parameter it
does not reach ready at once. The chunked loss skips the head's forward and reads its
weight afterwards; when the skipped head returned a tensor unconnected to its weight, DDP
took the weight for unused and the first backward failed ("Expected to mark a variable
ready only once"), so ``RingTrainer`` at cp > 1 with default ``TrainingArguments`` crashed.
The skipped head now computes its output for none of its rows, which keeps its weight in
the graph. Checked in a gloo world of 2 (one CP group): two backward passes of a tiny Llama
wrapped in DDP(find_unused_parameters=True), the chunked loss against the full logits'
loss: every gradient within 1e-6 relative (float32; the same token losses, summed by
chunks of 8 rows: measured ~1e-7).
"""

from __future__ import annotations

import torch

import eval_loss_run
from distributed import run_world
from reference_attention import rel_err


def _rank(rank: int, world: int) -> dict:
    import hf_ring
    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
    from hf_ring.training.loss import token_loss_sum

    hf_ring.setup_context_parallel(world)
    collate = hf_ring.RingDataCollator(eval_loss_run.PAD, cp_size=world, cp_rank=rank)
    batch = collate(eval_loss_run.eval_rows()[:2])
    shift_labels = batch.pop("shift_labels")
    batch.pop("labels")
    grads = {}
    for chunked in (True, False):
        model = eval_loss_run.tiny_llama("ring_flash")
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        for _ in range(2):
            ddp.zero_grad()
            if chunked:
                loss, _ = model_token_loss_sum(ddp, model, batch, shift_labels, ChunkedLossConfig(True, chunk_tokens=8))
            else:
                loss = token_loss_sum(ddp(**batch).logits, shift_labels)
            loss.backward()
        grads[chunked] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads


def test_chunked_loss_under_ddp_that_finds_unused_parameters():
    for grads in run_world(2, _rank):
        assert set(grads[True]) == set(grads[False])
        worst = max(rel_err(grads[True][n], grads[False][n]) for n in grads[False])
        print(f"\nchunked vs full logits under DDP(find_unused_parameters=True): worst gradient {worst:.1e}")
        assert worst <= 1e-6
