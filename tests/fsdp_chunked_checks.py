"""The chunked LM-head loss under FSDP2, checked in the spawned world of
tests/fsdp_world_checks.py (2 processes, cp 2): one training step of a tiny ring_flash Llama,
tied and untied embeddings, wrapped as Accelerate wraps it (each decoder layer a unit, the
tail ``[final norm, (embeddings,) lm_head]`` a unit with ``reshard_after_forward=False``,
then the root) or with the head left in the root's unit; the full gradient against the full
sequence's with full logits in this process. And the refusal of a head unit that reshards
after its forward.
"""

from __future__ import annotations

from typing import Any

import torch


def _tiny_model(tied: bool, attn_implementation: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _wrap(model: torch.nn.Module, mesh: Any, wrapping: str) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if wrapping != "root":
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        tail = [model.model.norm, model.model.embed_tokens, model.lm_head] if tied else [model.model.norm, model.lm_head]
        fully_shard(tail, mesh=mesh, reshard_after_forward=wrapping == "resharding_tail")
    return fully_shard(model, mesh=mesh)


def _step(tied: bool, mesh: Any, wrapping: str, rows: list[dict]) -> tuple[dict[str, torch.Tensor], int]:
    """One cp-2 step with the chunked loss (chunks of 5 rows): every parameter's full
    gradient, and the width of the forward's logits."""
    import hf_ring
    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
    from hf_ring.training.loss import all_reduce_sum, count_valid_tokens, loss_share

    state = hf_ring.setup_context_parallel(2)
    try:
        batch = hf_ring.RingDataCollator.for_state(state, 0)(rows)
        model = _wrap(_tiny_model(tied, "ring_flash"), mesh, wrapping)
        shift_labels = batch.pop("shift_labels")
        batch.pop("labels")
        count = all_reduce_sum(count_valid_tokens(shift_labels))
        token_sum, outputs = model_token_loss_sum(model, model, batch, shift_labels, ChunkedLossConfig(True, 5))
        (loss_share(token_sum, count) * mesh.size()).backward()  # FSDP2 averages over the mesh
    finally:
        hf_ring.set_context_parallel_state(None)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, outputs.logits.shape[-1]


def chunked_loss_checks(mesh: Any) -> dict:
    """``{(tied, wrapping): (relative gradient error, logits width)}`` and the refusal's message."""
    import hf_ring
    from hf_ring.training.loss import count_valid_tokens, loss_share, token_loss_sum

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 32, (32,), generator=g).tolist()
    rows = [{"input_ids": ids, "labels": [-100] * 9 + ids[9:]}]
    seen: dict = {}
    for tied in (False, True):
        full = hf_ring.RingDataCollator(0, cp_size=1)(rows)
        reference = _tiny_model(tied, "sdpa")
        logits = reference(input_ids=full["input_ids"], position_ids=full["position_ids"]).logits
        loss_share(token_loss_sum(logits, full["shift_labels"]), count_valid_tokens(full["shift_labels"])).backward()
        ref = dict(reference.named_parameters())
        for wrapping in ("accelerate", "root"):
            grads, width = _step(tied, mesh, wrapping, rows)
            assert sorted(grads) == sorted(ref)
            diff = torch.cat([(grads[n] - ref[n].grad).flatten() for n in ref]).norm()
            seen[(tied, wrapping)] = (float(diff / torch.cat([p.grad.flatten() for p in ref.values()]).norm()), width)
    try:
        _step(False, mesh, "resharding_tail", rows)
        seen["resharding_error"] = ""
    except NotImplementedError as e:
        seen["resharding_error"] = str(e)
    return seen
