"""``OneProcessDraws`` without a world: every CP rank's draws, made one rank after another
from the same generator state (as the ranks of a CP group hold it), put back in sequence
order, equal one process's draw on the full sequence bitwise; the generator ends where
one process's ends; what cannot be drawn so is refused by name.

Bitwise (``torch.equal``): the draw is the same op on the same shape from the same
generator state, and the product with a dropout's scale is the same multiplication.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_ring.hf.randomness.draws import OneProcessDraws
from hf_ring.hf.randomness.refusals import NoDraws, current_refusal, draws_refused
from hf_ring.sharding.layouts import shard_indices
from hf_ring.sharding.packed import packed_shard_indices

pytestmark = pytest.mark.quick

ROWS, SEQ, HIDDEN = 2, 32, 6
SEED = 1234


def _draws(index: torch.Tensor, cp: int, rows: int = ROWS, digests=(0, 0), tp_size: int = 1) -> OneProcessDraws:
    return OneProcessDraws(rows, index.numel(), cp, index, tuple(digests), tp_size=tp_size)


def _index(layout: str, cp: int, rank: int, seq: int = SEQ) -> torch.Tensor:
    if layout == "packed":  # documents of 8, 16 and 8 tokens, each a multiple of 2 * cp
        return packed_shard_indices(torch.tensor([0, 8, 24, 32]), cp, rank)
    return shard_indices(seq, cp, rank, layout)


def _per_rank(draw, layout: str, cp: int, axis: int = 1, flat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``draw(x_local)`` under the mode, unsharded, and the generator's state
    after the last rank's draw (each rank starts from the same state)."""
    pieces = []
    for rank in range(cp):
        index = _index(layout, cp, rank)
        torch.manual_seed(SEED)
        x = torch.arange(ROWS * SEQ * HIDDEN, dtype=torch.float32).view(ROWS, SEQ, HIDDEN) + 1.0
        local = x[:, index]
        if flat:
            local = local.reshape(ROWS * index.numel(), HIDDEN)
        with _draws(index, cp):
            out = draw(local)
        if flat:
            out = out.view(ROWS, index.numel(), HIDDEN)
        full = torch.zeros(ROWS, SEQ, HIDDEN)
        full[:, index] = out.to(full.dtype)
        pieces.append(full)
        after = torch.get_rng_state()
    return sum(pieces), after


def _one_process(draw, flat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(SEED)
    x = torch.arange(ROWS * SEQ * HIDDEN, dtype=torch.float32).view(ROWS, SEQ, HIDDEN) + 1.0
    out = draw(x.reshape(ROWS * SEQ, HIDDEN) if flat else x)
    return out.view(ROWS, SEQ, HIDDEN), torch.get_rng_state()


DRAWS = {
    "F.dropout": lambda x: F.dropout(x, 0.3, True),
    "nn.Dropout": lambda x: torch.nn.Dropout(0.1)(x),
    "dropout inplace": lambda x: F.dropout(x.clone(), 0.5, True, inplace=True),
    "torch.dropout": lambda x: torch.dropout(x, 0.2, True),
    # Mixtral's jitter, PhiMoE's Gumbel sampling and its Heun mask
    "uniform_ jitter": lambda x: x * torch.empty_like(x).uniform_(0.9, 1.1),
    "exponential_": lambda x: x - torch.empty_like(x).exponential_().log(),
    "rand_like uniform_": lambda x: (torch.rand_like(x).uniform_() > 0.75).float(),
    "randn_like": lambda x: x + torch.randn_like(x),
    "bernoulli_ float": lambda x: torch.empty_like(x).bernoulli_(0.3),
    "two draws": lambda x: F.dropout(F.dropout(x, 0.1, True), 0.2, True),
    # a (rows, seq, hidden) view with the hidden axis outermost in memory: drawn on that layout
    "permuted layout dropout": lambda x: F.dropout(x.transpose(1, 2).contiguous().transpose(1, 2), 0.3, True),
    "permuted layout rand_like": lambda x: torch.rand_like(x.transpose(1, 2).contiguous().transpose(1, 2)),
}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "stripe", "packed"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_ranks_draw_what_one_process_draws(name, cp, layout):
    draw = DRAWS[name]
    got, state = _per_rank(draw, layout, cp)
    ref, ref_state = _one_process(draw)
    assert torch.equal(got, ref.to(got.dtype)), name
    assert torch.equal(state, ref_state), "the generator must advance as in one process"


@pytest.mark.parametrize("name", ["exponential_", "rand_like uniform_", "F.dropout"])
def test_flattened_rows_draw_what_one_process_draws(name):
    """MoE routers flatten (batch, seq) into rows before drawing: row r * seq + t."""
    got, _ = _per_rank(DRAWS[name], "zigzag", 2, flat=True)
    ref, _ = _one_process(DRAWS[name], flat=True)
    assert torch.equal(got, ref.to(got.dtype))


def test_sized_draws_are_made_in_full():
    index = _index("zigzag", 2, 1)
    torch.manual_seed(SEED)
    ref = torch.rand(ROWS, SEQ, HIDDEN)[:, index]
    torch.manual_seed(SEED)
    with _draws(index, 2):
        got = torch.rand(ROWS, index.numel(), HIDDEN)
        assert torch.rand(3).shape == (3,)  # no sequence axis: drawn as it is
    assert torch.equal(got, ref)


def test_draws_without_a_sequence_axis_pass_through():
    index = _index("zigzag", 2, 0)
    torch.manual_seed(SEED)
    ref = F.dropout(torch.ones(5, 7), 0.5, True)
    torch.manual_seed(SEED)
    with _draws(index, 2):
        got = F.dropout(torch.ones(5, 7), 0.5, True)
        assert torch.equal(F.dropout(torch.ones(ROWS, index.numel()), 0.5, False), torch.ones(ROWS, index.numel()))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("op", [
    lambda x: torch.bernoulli(torch.sigmoid(x)),            # per-token probabilities
    lambda x: torch.multinomial(x.flatten(0, 1).softmax(-1), 1),
    lambda x: torch.empty_like(x).bernoulli_(torch.sigmoid(x)),
    lambda x: F.dropout1d(x, 0.1, True),
    lambda x: F.dropout(x.transpose(0, 1), 0.1, True),      # the sequence axis first
    lambda x: F.dropout(x.reshape(-1), 0.1, True),          # the tokens folded into one axis
    lambda x: F.dropout(x.reshape(x.shape[0], -1), 0.1, True),
])
def test_other_draws_on_sequence_tensors_are_refused(op):
    index = _index("zigzag", 2, 0)
    with _draws(index, 2), pytest.raises(NotImplementedError, match="set that probability or noise to 0"):
        op(torch.randn(ROWS, index.numel(), HIDDEN))


def test_refused_beside_tensor_parallelism():
    index = _index("zigzag", 2, 0)
    with _draws(index, 2, tp_size=2), pytest.raises(NotImplementedError, match="tensor parallelism"):
        F.dropout(torch.randn(ROWS, index.numel(), HIDDEN), 0.1, True)


def test_generators_that_differ_are_refused_at_the_first_draw():
    index = _index("zigzag", 2, 0)
    x = torch.randn(ROWS, index.numel(), HIDDEN)
    with _draws(index, 2, digests=(7, 8)):
        assert torch.equal(F.dropout(x, 0.1, False), x)  # nothing drawn: nothing to agree on
        with pytest.raises(RuntimeError, match=r"CP rank\(s\) \[1\]"):
            F.dropout(x, 0.1, True)



def test_no_draws_refuses_every_draw_but_lets_the_rest_run():
    """The split vision tower's mode: each rank encodes its own share of the images."""
    x = torch.randn(3, 4)
    with NoDraws("a tower"):
        assert torch.equal(F.dropout(x, 0.5, False), x)  # eval: nothing drawn
        assert torch.equal(F.dropout(x, 0.0, True), x)
        for draw in (lambda: F.dropout(x, 0.5, True), lambda: torch.rand(3), lambda: torch.rand_like(x),
                     lambda: x.clone().uniform_()):
            with pytest.raises(NotImplementedError, match="draws random numbers in a tower"):
                draw()


def test_a_refusal_set_by_the_caller_refuses_sharded_draws_only():
    index = _index("zigzag", 2, 0)
    with draws_refused("rows laid out otherwise"):
        draws = OneProcessDraws(ROWS, index.numel(), 2, index, (0, 0), refusal=current_refusal())
    assert current_refusal() is None
    with draws:
        F.dropout(torch.randn(5, 7), 0.5, True)  # no sequence axis: made as it is
        with pytest.raises(NotImplementedError, match="rows laid out otherwise"):
            F.dropout(torch.randn(ROWS, index.numel(), HIDDEN), 0.1, True)


class _Called(Exception):
    pass


def test_trl_fused_forward_refuses_draws_where_its_rows_are_not_trls():
    """RingFusedForward runs TRL's rows as they are where their length is a multiple of the
    layout's (the masks are one process's), and refuses draws where it pads them or packs them."""
    from closeness import fake_cp_state
    from hf_ring.training.trl.fused_forward import RingFusedForward

    seen = []

    def model(**kwargs):
        seen.append(current_refusal())
        raise _Called

    for packed, seq in ((False, 8), (False, 7), (True, 8)):
        forward = RingFusedForward(model, fake_cp_state(0, 2), packed=packed)
        ids = torch.ones(2, seq, dtype=torch.long)
        with pytest.raises(_Called):
            forward(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), fused_lm_head=True)
    assert seen[0] is None
    assert "rows of 7 tokens run padded to 8" in seen[1]
    assert "padding_free" in seen[2]
