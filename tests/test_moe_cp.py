"""Mixture-of-experts models under context parallelism: the router's load-balancing loss over
the whole sequence, and transformers' expert parallelism beside CP.

The loss is what the stock model trains, ``cross-entropy + router_aux_loss_coef * aux``
(``aux``: transformers' ``load_balancing_loss_func`` over every layer's router logits). Each
CP rank adds its share of the cross-entropy and ``coef * aux / cp``, with ``aux`` computed
over the CP group's whole sequence (hf_ring/hf/support/router_balance.py), as RingTrainer
does. Compared with one process on the full row (SDPA, float32; ``router_aux_loss_coef=0.5``
so that the term weighs in the gradients), 2 gloo ranks:

- ``cp2``: the model whole on each rank; gradients summed over the ranks.
- ``ep2_cp2``: loaded with ``DistributedConfig(ep_size=2, fsdp_size=2)``: each rank holds 2 of
  the 4 experts, tokens routed to the other rank's experts by all-to-all, FSDP2 over the two
  CP ranks (its average undone by a loss times 2); gradients ``full_tensor()``.

Each with and without a right-padding ``attention_mask`` (the stock collator's), which
``aux`` weighs tokens by. Tolerance 2e-5 relative to the largest value (float32 sums in
other orders; the measured worst is in docs/parallelism.md). With ``aux`` computed on each
rank's shard alone instead, the gradients are off by 0.28 to 1.1 (relative) in every case.
"""

from __future__ import annotations

import pytest
import torch

import tensor_parallel_loading
from distributed import run_world

SEQ, VOCAB, TOL, COEF = 32, 64, 2e-5, 0.5
FAMILIES = ("qwen3_moe", "mixtral")
PADDING = 6  # tokens of padding at the end of the masked row


def _save_models(root: str) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=COEF,
                 max_position_embeddings=128)
    for family, model in (
        ("qwen3_moe", Qwen3MoeForCausalLM(Qwen3MoeConfig(**small, moe_intermediate_size=16, num_experts=4,
                                                         intermediate_size=64, head_dim=8))),
        ("mixtral", MixtralForCausalLM(MixtralConfig(**small, intermediate_size=16, num_local_experts=4))),
    ):
        torch.manual_seed(0)
        model.apply(model._init_weights)
        model.save_pretrained(f"{root}/{family}")


def _row(masked: bool) -> dict[str, torch.Tensor]:
    """``input_ids``, labels shifted on the full row (-100 over padding), ``position_ids``,
    int64 ``(1, SEQ)``; and the ``attention_mask`` (0 over the last :data:`PADDING` tokens) if
    ``masked``."""
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    real = SEQ - PADDING if masked else SEQ
    shift = torch.full_like(ids, -100)
    shift[:, : real - 1] = ids[:, 1:real]
    out = dict(ids=ids, shift=shift, positions=torch.arange(SEQ)[None])
    if masked:
        out["mask"] = (torch.arange(SEQ) < real).long()[None]
    return out


def _reference(path: str, row: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The stock model's own loss (cross-entropy mean + coef * aux) and its gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    out = model(input_ids=row["ids"], attention_mask=row.get("mask"), labels=row["ids"] if "mask" not in row
                else torch.where(row["mask"].bool(), row["ids"], -100))
    out.loss.backward()
    return out.loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def _moe_cases(rank: int, world: int, root: str) -> dict:
    import hf_ring
    from transformers import AutoModelForCausalLM

    from hf_ring.hf.support.router_balance import router_balance_loss, router_balance_of
    from hf_ring.sharding import shard_sequence

    state = hf_ring.setup_context_parallel(cp_size=2)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 2, state.cp_rank, dim=1, layout=state.layout)

    results = {}
    for family in FAMILIES:
        path = f"{root}/{family}"
        models = {"cp2": AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring_flash",
                                                              dtype=torch.float32)}
        if tensor_parallel_loading.AVAILABLE:
            from transformers.distributed import DistributedConfig

            models["ep2_cp2"] = AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="ring_flash", dtype=torch.float32,
                distributed_config=DistributedConfig(ep_size=2, fsdp_size=2))
        for masked in (False, True):
            row = _row(masked)
            ref_loss, ref_grads = _reference(path, row)
            count = (row["shift"] != -100).sum()
            for mode, model in models.items():
                balance = router_balance_of(model)
                model.zero_grad(set_to_none=True)
                mask = shard(row["mask"]) if masked else None
                out = model(input_ids=shard(row["ids"]), position_ids=shard(row["positions"]), attention_mask=mask)
                ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), shard(row["shift"]).flatten(),
                                                       reduction="sum")
                aux = router_balance_loss(tuple(out.router_logits), balance, mask, state.cp_group)
                share = ce / count + balance.coef * aux / 2
                fsdp = mode == "ep2_cp2"  # FSDP2 averages over the 2 ranks; without it, gradients are summed
                (share * (2 if fsdp else 1)).backward()
                total = share.detach().clone()
                torch.distributed.all_reduce(total, group=state.cp_group)
                grads = {}
                for n, p in model.named_parameters():
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    if not fsdp:
                        g = g.clone()
                        torch.distributed.all_reduce(g, group=state.cp_group)
                    grads[n] = g
                results[(family, mode, masked)] = {
                    "loss": abs(total.item() - ref_loss) / ref_loss,
                    "grads": {n: _relative(g, ref_grads[n]) for n, g in grads.items()},
                    "experts_local": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                         for n, p in model.named_parameters() if ".experts." in n),
                    "experts_full": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
                }
    return results


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("moe_models"))
    _save_models(root)
    return run_world(2, _moe_cases, root)


CASES = [(f, m, masked) for f in FAMILIES for m in ("cp2", "ep2_cp2") for masked in (False, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'masked' if c[2] else 'full'}")
def test_moe_under_cp_trains_what_one_process_trains(moe_results, case):
    if case[1] == "ep2_cp2" and not tensor_parallel_loading.AVAILABLE:
        pytest.skip("transformers' DistributedConfig(ep_size, fsdp_size) is 5.x only")
    for rank, r in enumerate(results[case] for results in moe_results):
        assert r["loss"] < TOL, (rank, r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < TOL, (rank, worst, r["grads"][worst])
        if case[1] == "ep2_cp2":  # each rank really holds half of the experts
            assert 2 * r["experts_local"] == r["experts_full"], r


def test_per_shard_aux_is_not_the_whole_sequences():
    """What the group sums are for: one process's ``aux`` of a row is not the mean of its
    halves' (the hazard the CP sums avoid), and hf_ring's reproduction equals the family's
    function on the whole row."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from hf_ring.hf.support.router_balance import RouterBalance, router_balance_loss

    g = torch.Generator().manual_seed(3)
    logits = tuple(torch.randn(SEQ, 4, generator=g) * 2 for _ in range(2))
    balance = RouterBalance(4, 2, COEF, "test")
    whole = load_balancing_loss_func(logits, 4, 2)
    ours = router_balance_loss(logits, balance, None, None, distributed=False)
    halves = [router_balance_loss(tuple(x[i::2] for x in logits), balance, None, None, distributed=False)
              for i in range(2)]
    assert abs(ours - whole) < 1e-6 * whole
    assert abs(sum(halves) / 2 - whole) > 1e-3 * whole, (halves, whole)
