"""Checks of hf_ring.training.weight_sharding and of the CPU FSDP patch, run on every rank of one
spawned gloo world of 2 processes (cp_size 2) by tests/test_trainer_fsdp.py; and the
gradient error that the refused dp-only FSDP mesh would cause.

Each returns what it saw (kinds, multipliers, error messages) for the test to assert on;
the whole sequence shares one world to keep CI short.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def _tiny_model(attn_implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _loss(model: torch.nn.Module, batch: dict, count: torch.Tensor) -> torch.Tensor:
    from hf_ring.training.loss import loss_share, token_loss_sum

    batch = dict(batch)
    shift_labels = batch.pop("shift_labels")
    batch.pop("labels")
    return loss_share(token_loss_sum(model(**batch).logits, shift_labels), count)


def _fsdp2_gradient_error(mesh: Any) -> float:
    """One cp-2 training step of a ring_flash model sharded by FSDP2 over ``mesh``, the share
    multiplied by the mesh's size (what the wrapper averages over): the relative error of the
    full gradient against the full sequence's in this process."""
    from torch.distributed.fsdp import fully_shard

    import hf_ring
    from hf_ring.training.loss import all_reduce_sum, count_valid_tokens

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32, (32,), generator=g).tolist()
    rows = [{"input_ids": ids, "labels": [-100] * 20 + ids[20:]}]
    full = hf_ring.RingDataCollator(0, cp_size=1)(rows)
    reference = _tiny_model()
    _loss(reference, full, count_valid_tokens(full["shift_labels"])).backward()

    state = hf_ring.setup_context_parallel(2)
    batch = hf_ring.RingDataCollator.for_state(state, 0)(rows)
    model = fully_shard(_tiny_model("ring_flash"), mesh=mesh)
    count = all_reduce_sum(count_valid_tokens(batch["shift_labels"]))
    (_loss(model, batch, count) * mesh.size()).backward()
    hf_ring.set_context_parallel_state(None)
    names = [n for n, _ in reference.named_parameters()]
    got = dict(model.named_parameters())
    diff = torch.cat([(got[n].grad.full_tensor() - p.grad).flatten() for n, p in reference.named_parameters()])
    norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()
    assert sorted(names) == sorted(got)
    return float(diff.norm() / norm)


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _prepare(fsdp: bool) -> torch.nn.Module:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = _tiny_model()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def world_checks(rank: int, world: int) -> dict:
    """Run every check in order; return what each saw."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import DTensor

    from hf_ring.training.weight_sharding import gradient_reduction
    from hf_ring.patches import accelerate as accelerate_patches

    # Accelerate's launcher would set these; the spawned world has only the process group.
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    seen: dict = {}

    # 1. DDP over the world, without FSDP asked for.
    model = _prepare(fsdp=False)
    reduction = gradient_reduction(model)
    seen["ddp"] = (type(model).__name__, reduction.kind, reduction.multiplier)
    del model
    _reset_accelerate()

    # 2. accelerate 1.15 unpatched: FSDP asked for, DDP delivered; hf_ring refuses it.
    model = _prepare(fsdp=True)
    seen["unpatched_class"] = type(model).__name__
    seen["unpatched_error"] = _error(lambda: gradient_reduction(model, fsdp_requested=True))
    del model
    _reset_accelerate()

    # 3. patched: the model is an FSDP2 module with DTensor shards over both ranks.
    accelerate_patches.enable_fsdp_on_cpu()
    model = _prepare(fsdp=True)
    seen["patched_is_fsdp2"] = isinstance(model, FSDPModule)
    seen["patched_all_dtensor"] = all(isinstance(p, DTensor) for p in model.parameters())
    reduction = gradient_reduction(model, fsdp_requested=True)
    seen["patched"] = (reduction.kind, reduction.multiplier, reduction.mesh_shape)
    del model
    _reset_accelerate()

    # 4. An FSDP2 mesh over the data-parallel ranks only (dp_size 1 here: each rank alone),
    #    DDP over such a subgroup, a bare model in a world of 2, and FSDP1 are refused.
    alone = dist.new_group([0]), dist.new_group([1])  # new_group is collective: both ranks make both
    mine = alone[rank]
    dp_mesh = DeviceMesh.from_group(mine, "cpu")
    model = fully_shard(_tiny_model(), mesh=dp_mesh)
    seen["dp_only_mesh_error"] = _error(lambda: gradient_reduction(model))
    seen["ddp_subgroup_error"] = _error(
        lambda: gradient_reduction(torch.nn.parallel.DistributedDataParallel(_tiny_model(), process_group=mine))
    )
    seen["bare_error"] = _error(lambda: gradient_reduction(_tiny_model()))
    fsdp1 = FullyShardedDataParallel(_tiny_model(), device_id=torch.device("cpu"))
    seen["fsdp1_error"] = _error(lambda: gradient_reduction(fsdp1))

    # 5. Why: the same cp-2 step, gradients reduced over the world's mesh or the dp-only one.
    seen["world_mesh_gradient_error"] = _fsdp2_gradient_error(DeviceMesh("cpu", list(range(world))))
    seen["dp_only_mesh_gradient_error"] = _fsdp2_gradient_error(dp_mesh)

    # 6. The chunked LM-head loss under FSDP2 (tests/fsdp_chunked_checks.py).
    from fsdp_chunked_checks import chunked_loss_checks

    seen["chunked"] = chunked_loss_checks(DeviceMesh("cpu", list(range(world))))
    return seen
