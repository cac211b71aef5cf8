"""Context parallelism on an 8-process N-D mesh: dp2 x cp2 x tp2, and cp4 x tp2.

Both models are loaded the Hugging Face way, ``from_pretrained(dir,
distributed_config=DistributedConfig(tp_size=2, fsdp_size=4))``: transformers' dense mesh
``(pp, dp_replicate, fsdp, tp)`` over 8 gloo ranks, TP innermost, FSDP2 over the 4 ranks
of each TP coordinate. hf_ring's mesh ``(dp_shard, cp, tp)`` lays the same ranks out, so
FSDP shards over ``dp x cp`` (torchtitan's ``fsdp = dp_shard x cp``) whichever way the 4
are split:

- ``setup_context_parallel(cp_size=2, tp_size=2)``: dp2 x cp2 x tp2. Data coordinate ``d``
  (ranks ``4d .. 4d + 3``) gets row ``d`` of a 2-row batch; the loss is the token mean over
  both rows, as one process computes it on the batch.
- ``setup_context_parallel(cp_size=4, tp_size=2)``: cp4 x tp2, where the hybrid pattern
  (Ulysses over 2 ranks inside a ring of 2) has 4 CP ranks per TP coordinate.

For Llama and Qwen3 (its q/k norms per head), compared with one process on the full batch
(SDPA, float32): each rank's logits of its shard, the loss, every parameter's gradient
(``grad.full_tensor()``), and, for one case, every weight after an SGD step. A rank's loss
is its share of the token sum over the global count, times 4: FSDP2 averages gradients
over its 4 ranks. Tolerance 2e-5 relative to the largest value: float32 on a tiny model, with
attention summed over ring steps and TP's partial sums in other orders; the worst measured
errors are quoted in docs/parallelism.md. Feeding both data coordinates the same row, or a
ring across TP coordinates, is off by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

import tensor_parallel_loading
from distributed import run_world

if not tensor_parallel_loading.AVAILABLE:
    pytest.skip("transformers' DistributedConfig(tp_size, fsdp_size) is 5.x only", allow_module_level=True)

WORLD, TP, SEQ, VOCAB = 8, 2, 32, 64
TOL = 2e-5
DOCS = (8, 24)  # a packed row's documents, each a multiple of 2 * cp at cp 2 and 4
FAMILIES = ("llama", "qwen3")
# (family, cp_size, pattern, packed); dp = WORLD / (cp_size * TP).
CASES = (
    ("llama", 2, "ring", False),
    ("llama", 2, "allgather", False),
    ("llama", 2, "ulysses", False),
    ("llama", 2, "ring", True),
    ("llama", 4, "hybrid", False),
    ("llama", 4, "ring", True),
    ("qwen3", 4, "hybrid", False),
    ("qwen3", 2, "ring", False),
)
STEPPED = CASES[-1]  # the case whose weights are compared after an SGD step: last, as it changes them
LR = 0.5


def _case_id(case: tuple) -> str:
    family, cp, pattern, packed = case
    return f"{family}-dp{WORLD // (cp * TP)}xcp{cp}xtp{TP}-{pattern}{'-packed' if packed else ''}"


def _save_models(root: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    for family, config, cls in (("llama", LlamaConfig(**sizes), LlamaForCausalLM),
                                ("qwen3", Qwen3Config(**sizes, head_dim=4), Qwen3ForCausalLM)):
        torch.manual_seed(0)
        cls(config).save_pretrained(f"{root}/{family}")


def _rows(packed: bool, n_rows: int) -> dict[str, torch.Tensor]:
    """``n_rows`` rows of the full batch: ``input_ids``, ``position_ids`` and labels shifted
    inside each document (int64 ``(n_rows, SEQ)``); packed rows hold :data:`DOCS`, with
    ``cu_seqlens`` int32 ``(len(DOCS) + 1,)``."""
    ids = torch.randint(0, VOCAB, (n_rows, SEQ), generator=torch.Generator().manual_seed(1))
    docs = DOCS if packed else (SEQ,)
    positions = torch.cat([torch.arange(n) for n in docs]).expand(n_rows, SEQ)
    shift = torch.full_like(ids, -100)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        shift[:, a : b - 1] = ids[:, a + 1 : b]
    return dict(ids=ids, positions=positions.clone(), shift=shift, cu=cu)


def _reference(path: str, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict, dict]:
    """One process on the full batch, each document alone: logits ``(rows, SEQ, VOCAB)``, the
    token-mean loss, the gradients, and the weights after one SGD step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    cu = rows["cu"].tolist()
    logits = torch.cat([model(input_ids=rows["ids"][:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], 1)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows["shift"].flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return logits.detach(), loss.item(), grads, {n: p.detach() for n, p in model.named_parameters()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _nd_cases(rank: int, world: int, root: str) -> dict:
    """Per case: this rank's coordinates and relative errors against one process."""
    import hf_ring
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.sharding import shard_packed, shard_sequence

    models = {f: AutoModelForCausalLM.from_pretrained(
        f"{root}/{f}", distributed_config=DistributedConfig(tp_size=TP, fsdp_size=WORLD // TP),
        attn_implementation="ring_flash", dtype=torch.float32) for f in FAMILIES}
    results = {}
    for case in CASES:
        family, cp, pattern, packed = case
        state = hf_ring.setup_context_parallel(cp_size=cp, tp_size=TP, pattern=pattern,
                                               ulysses_size=2 if pattern == "hybrid" else None)
        rows = _rows(packed, state.dp_size)
        ref_logits, ref_loss, ref_grads, ref_stepped = _reference(f"{root}/{family}", rows)
        cu = rows["cu"]

        def shard(t: torch.Tensor) -> torch.Tensor:
            row = t[state.dp_rank : state.dp_rank + 1]
            if packed:
                return shard_packed(row, cu, cp, state.cp_rank, dim=1)
            return shard_sequence(row, cp, state.cp_rank, dim=1, layout=state.layout)

        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS)) \
            if packed else {}
        model = models[family]
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=shard(rows["ids"]), position_ids=shard(rows["positions"]), **extra).logits
        count = (rows["shift"] != -100).sum()
        local = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard(rows["shift"]).flatten(),
                                                  reduction="sum")
        (local / count * state.loss_size).backward()  # FSDP2 averages over the dp x cp ranks it shards over
        loss = local.detach().clone()
        torch.distributed.all_reduce(loss, group=state.loss_group)
        result = {
            "coords": (state.dp_rank, state.cp_rank, state.tp_rank),
            "cp_ranks": state.cp_ranks,
            "logits": _relative(logits.detach(), shard(ref_logits)),
            "loss": abs(loss.item() / count.item() - ref_loss) / ref_loss,
            "grads": {n: _relative(_full(p.grad), ref_grads[n]) for n, p in model.named_parameters()},
        }
        if case == STEPPED:
            torch.optim.SGD(model.parameters(), lr=LR).step()
            result["stepped"] = {n: _relative(_full(p.detach()), ref_stepped[n]) for n, p in model.named_parameters()}
        results[case] = result
    return results


@pytest.fixture(scope="module")
def nd_results(tmp_path_factory) -> list[dict]:
    """Every rank's results of every case, from one 8-process world."""
    root = str(tmp_path_factory.mktemp("nd_models"))
    _save_models(root)
    return run_world(WORLD, _nd_cases, root)


def _expected_coords(rank: int, cp: int) -> tuple[int, int, int]:
    """hf_ring's mesh order: rank = (dp * cp + cp_rank) * TP + tp_rank."""
    rest, tp = divmod(rank, TP)
    dp, c = divmod(rest, cp)
    return dp, c, tp


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_nd_mesh_computes_what_one_process_computes(nd_results, case):
    _, cp, _, _ = case
    for rank, r in enumerate(results[case] for results in nd_results):
        assert r["coords"] == _expected_coords(rank, cp), (rank, r["coords"])
        dp, _, tp = r["coords"]
        assert r["cp_ranks"] == tuple((dp * cp + c) * TP + tp for c in range(cp)), (rank, r["cp_ranks"])
        assert r["logits"] < TOL, (rank, r["logits"])
        assert r["loss"] < TOL, (rank, r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < TOL, (rank, worst, r["grads"][worst])
        assert len(r["grads"]) >= 21  # every parameter of the 2-layer model compared
        if case == STEPPED:
            worst = max(r["stepped"], key=r["stepped"].get)
            assert r["stepped"][worst] < TOL, (rank, worst, r["stepped"][worst])
