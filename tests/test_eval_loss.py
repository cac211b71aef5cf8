"""``RingTrainer`` reports the stock ``Trainer``'s eval_loss, at cp 1 and cp 2, padded and packed.

The stock number is the mean over eval samples of their batch's token-mean loss (each
batch's loss repeated ``eval_batch_size`` times, gathered, cut to the dataset's samples at
the end), not the token mean over the set. tests/eval_loss_run.py evaluates one tiny Llama
(float32, fixed weights) on 5 rows of 20 to 250 tokens with part of each row's labels
masked, eval batch 2: batches of 2, 2 and 1 rows whose valid-token counts differ, so the two
means differ (by ~1e-3 here, checked: otherwise this test could not fail). Compared against
the stock ``Trainer`` with plain SDPA on right-padded rows in this process:

- ``RingTrainer`` at cp 1 (this process) and cp 2 (2 processes, one CP group, zigzag),
  padded rows and packed rows (a batch's documents in one row: the same tokens, the same
  per-token losses, so the same batch means as the padded stock run);
- within 1e-6 relative: float32 logits, the same token losses summed in another order
  (over two shards, or over a packed row); measured below 1e-7.

``eval_token_loss``, logged beside it, is the token mean over the whole set (also checked).
``predict()`` on the padded rows, at cp 1 and on both ranks at cp 2, returns the stock
Trainer's rows: the logits of every row's tokens, gathered over the CP group in order, its
labels (shifted: ``shift_labels``) and ``test_loss``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from test_trainer_cp import ROOT, _run, fresh_process_state  # noqa: F401  (a fixture)

sys.path.insert(0, os.path.join(ROOT, "tests"))
import eval_loss_run  # noqa: E402

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TOL = 1e-6
SCRIPT = os.path.join(ROOT, "tests", "eval_loss_run.py")


def _token_mean() -> float:
    model = eval_loss_run.tiny_llama().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in eval_loss_run.eval_rows():
            logits = model(torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int(labels.ne(-100).sum())
    return total / count


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from accelerate.state import AcceleratorState

    out = tmp_path_factory.mktemp("eval_loss")
    stock, stock_predicted = eval_loss_run.stock_eval(str(out / "stock"))
    AcceleratorState._reset_state(reset_partial_state=True)
    cp1, predicted = {}, {"stock": stock_predicted}
    for name, packing in (("padded", False), ("packed", True)):
        cp1[name], predicted_here = eval_loss_run.ring_eval(1, str(out / f"cp1_{name}"), packing)
        predicted.setdefault("cp1", predicted_here)
        AcceleratorState._reset_state(reset_partial_state=True)
    import hf_ring

    hf_ring.set_context_parallel_state(None)
    _run(2, [SCRIPT, "2", str(out / "cp2.json")])
    with open(out / "cp2.json") as f:
        cp2 = json.load(f)
    for rank in range(2):
        predicted[f"cp2_rank{rank}"] = torch.load(f"{out / 'cp2.json'}.rank{rank}.pt", weights_only=False)
    return {"stock": stock, "cp1": cp1, "cp2": cp2, "predicted": predicted}


def test_the_stock_mean_is_not_the_token_mean(results):
    stock, token_mean = results["stock"]["eval_loss"], _token_mean()
    assert abs(stock - token_mean) > 100 * TOL * stock, (stock, token_mean)


@pytest.mark.parametrize("cp", ["cp1", "cp2"])
@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_eval_loss_is_the_stock_trainers(results, cp, rows):
    stock, got = results["stock"]["eval_loss"], results[cp][rows]
    print(f"\n{cp} {rows}: eval_loss {got['eval_loss']!r} vs stock {stock!r}, "
          f"relative {abs(got['eval_loss'] - stock) / stock:.1e}")
    assert abs(got["eval_loss"] - stock) <= TOL * stock
    token_mean = _token_mean()
    assert abs(got["eval_token_loss"] - token_mean) <= TOL * token_mean


@pytest.mark.parametrize("run", ["cp1", "cp2_rank0", "cp2_rank1"])
def test_predict_returns_the_stock_trainers_rows(results, run):
    """``predict()`` at cp 2 returns on every rank whole rows in order, as the stock Trainer:
    each row's logits at its real tokens within 1e-5 (float32 logits, the ring's online
    softmax against SDPA's one pass; measured 8.9e-8), its labels shifted (position t: the
    token it predicts, -100 beyond the row), and test_loss the stock one within 1e-6."""
    stock, got = results["predicted"]["stock"], results["predicted"][run]
    assert got["predictions"].shape[:1] == stock["predictions"].shape[:1] == (len(eval_loss_run.LENGTHS),)
    worst = 0.0
    for i, length in enumerate(eval_loss_run.LENGTHS):
        worst = max(worst, (got["predictions"][i, :length] - stock["predictions"][i, :length]).abs().max().item())
        assert torch.equal(got["label_ids"][i, : length - 1], stock["label_ids"][i, 1:length]), i
        assert bool((got["label_ids"][i, length - 1:] == -100).all()), i
    print(f"\n{run}: predict() logits max |difference| from the stock Trainer's {worst:.1e}")
    assert worst <= 1e-5, worst
    loss, ref = got["metrics"]["test_loss"], stock["metrics"]["test_loss"]
    assert abs(loss - ref) <= TOL * ref, (loss, ref)
    if run.startswith("cp2"):  # packed rows: each document sharded on its own, refused by name
        assert "predictions of packed rows under context parallelism" in got["packed"]["refused"], got["packed"]
