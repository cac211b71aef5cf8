"""How the wrapped model reduces gradients, and the loss multiplier that makes them exact.

Each rank's loss is its *share* of the world's token mean (:mod:`hf_ring.training.loss`); the
true gradient is the *sum* of the shares' gradients over every dp x cp rank. Data-parallel
wrappers average instead of summing, over the ranks of their reduction group, so the share
is multiplied by that group's size before ``backward``. That is exact only when the group
is the whole world: a wrapper that reduces over fewer ranks (an FSDP mesh over the
data-parallel ranks only, DDP over a subgroup) leaves the CP ranks' gradients apart, and
their weights drift (a gradient error of 0.73 was measured with a dp-only FSDP mesh).

:func:`gradient_reduction` reads the reduction group from the wrapped model itself (DDP's
process group; FSDP2's device mesh, carried by every sharded parameter as a DTensor),
refuses a group that is not the whole world, and refuses a model that FSDP was asked to
shard but that was wrapped otherwise (Accelerate on CPU silently falls back to DDP; see
:func:`hf_ring.patches.accelerate.enable_fsdp_on_cpu`).

FSDP2 averages over every rank of its mesh: one dimension for a full shard, both for HSDP
(reduce-scatter over the shard dimension, all-reduce over the replicate one); beside tensor
parallelism (a model loaded with transformers' ``DistributedConfig``, its mesh ``(..., fsdp,
tp)``) over every dimension but ``tp``, which must then hold the dp x cp ranks. The experts
of transformers' expert parallelism (mesh ``(..., efsdp, ep)``) are reduced over ``efsdp``
but divided by the divide factor transformers sets (``dp_size``), since their gradient
gathers every rank's tokens: that factor must be the dp x cp ranks. Any other divide factor
of one's own (``FSDPModule.set_gradient_divide_factor``) on dense weights is not seen here:
leave FSDP2's default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from packaging.version import Version

from hf_ring.distributed.grad_average import averaged_over

NONE, DDP, FSDP2, HSDP, ZERO = "none", "ddp", "fsdp2", "hsdp", "zero"


@dataclass(frozen=True)
class GradientReduction:
    """How gradients are reduced: ``kind`` (none, ddp, fsdp2 full shard, hsdp, DeepSpeed zero) over
    ``group_size`` processes, the mesh's shape for FSDP2 (``(world,)`` or ``(replicate, shard)``)."""

    kind: str
    group_size: int
    mesh_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in (NONE, DDP, FSDP2, HSDP, ZERO):
            raise ValueError(f"unknown gradient reduction kind {self.kind!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")

    @property
    def multiplier(self) -> int:
        """What each rank's loss share is multiplied by: the wrapper averages over the group."""
        return self.group_size

    def describe(self) -> str:
        if self.kind == NONE:
            return "gradients: one process, no reduction"
        where = f"mesh {self.mesh_shape} " if self.mesh_shape else ""
        return f"gradients: {self.kind} {where}over {self.group_size} processes (loss share x{self.multiplier})"


def _world() -> tuple[int, list[int]]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, [0]
    world = dist.get_world_size()
    return world, list(range(world))


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _refuse_fsdp1(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise NotImplementedError(
            "the model is wrapped in FSDP1 (FullyShardedDataParallel), which hf_ring does not support under "
            "context parallelism; use FSDP2: fsdp_config={'version': 2} in TrainingArguments, or "
            "fsdp_version: 2 in the Accelerate config"
        )


# The mesh dimension of tensor parallelism (transformers' and torchtitan's name): FSDP2 does not
# reduce gradients over it (each TP rank holds other columns of the weights).
_TP_DIM = "tp"
# The expert mesh's expert-parallel dimension (transformers' ``(pp, dp_replicate, efsdp, ep)``).
_EP_DIM = "ep"


def _data_submesh(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The part of a parameter's device mesh that FSDP2 averages its gradient over, at this
    rank's TP coordinate: ``(shape, sorted global ranks, the TP dimension's size)``."""
    names = tuple(mesh.mesh_dim_names or ())
    if _TP_DIM not in names:
        return tuple(mesh.mesh.shape), tuple(sorted(mesh.mesh.flatten().tolist())), 1
    tp_dim = names.index(_TP_DIM)
    index = [slice(None)] * mesh.mesh.dim()
    index[tp_dim] = mesh.get_coordinate()[tp_dim]
    data = mesh.mesh[tuple(index)]
    return tuple(data.shape), tuple(sorted(data.flatten().tolist())), mesh.mesh.shape[tp_dim]


def _check_expert_param(name: str, param: Any, factor: Optional[float], world: int, world_ranks: list[int],
                        tp_size: int) -> None:
    """An expert of transformers' expert parallelism (mesh ``(..., efsdp, ep)``): its gradient
    gathers every rank's tokens through the dispatch's all-to-all and is divided by the divide
    factor transformers sets, which must be the world's dp x cp ranks, as the dense weights'."""
    if tp_size > 1:
        raise NotImplementedError(
            f"parameter {name!r} is expert-parallel beside tensor parallelism (tp_size={tp_size}): not checked "
            "against one process; use expert parallelism with tp_size=1")
    ranks = sorted(param.device_mesh.mesh.flatten().tolist())
    if ranks != world_ranks or factor is None or factor != world:
        raise ValueError(
            f"expert parameter {name!r} reduces its gradient over ranks {ranks} divided by {factor} (None: its "
            f"efsdp group's size), but the loss shares add up over the world of {world}: its gradient would be off "
            "by their ratio. Load the model with transformers' DistributedConfig(ep_size=..., fsdp_size=<dp x cp>)")


def _fsdp2_reduction(model: torch.nn.Module, world: int, world_ranks: list[int], tp_size: int) -> GradientReduction:
    from torch.distributed.tensor import DTensor

    from hf_ring.patches.torch import fsdp2_gradient_divide_factors

    factors: Optional[dict] = None  # read (a private internal of torch) only for an expert-parallel model
    holder = {f"{prefix}.{n}" if prefix else n: (id(m), n)
              for prefix, m in model.named_modules() for n, _ in m.named_parameters(recurse=False)}
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], str] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or averaged_over(param) == world // tp_size:
            continue  # frozen, or an adapter added after the load-time FSDP2 (training/adapters.py)
        if not isinstance(param, DTensor):
            raise ValueError(
                f"parameter {name!r} of the FSDP2 model is not sharded (not a DTensor): its gradient is not "
                "reduced across processes; shard every trainable parameter (no ignored_params)"
            )
        if _EP_DIM in (param.device_mesh.mesh_dim_names or ()):
            factors = fsdp2_gradient_divide_factors(model) if factors is None else factors
            _check_expert_param(name, param, factors.get(holder.get(name)), world, world_ranks, tp_size)
            continue
        shape, ranks, mesh_tp = _data_submesh(param.device_mesh)
        if mesh_tp not in (1, tp_size):
            raise ValueError(
                f"parameter {name!r} is sharded over a tensor-parallel mesh dimension of {mesh_tp} ranks but the "
                f"context-parallel state has tp_size={tp_size}; give RingAttentionPlugin the model's tp_size"
            )
        meshes[(shape, ranks)] = name
    expected = world // tp_size
    if not meshes and any(averaged_over(p) == expected for p in model.parameters() if p.requires_grad):
        # Only adapters train (the base frozen): each gradient averaged over the dp x cp ranks as it arrives.
        return GradientReduction(DDP, expected)
    if len(meshes) != 1:
        shapes = sorted(shape for shape, _ in meshes)
        raise ValueError(
            f"the FSDP2 model's parameters average their gradients over {len(meshes)} different groups of ranks "
            f"{shapes}; hf_ring needs one, over every data-parallel x context-parallel rank, for all of them"
        )
    ((shape, ranks),) = meshes
    if len(ranks) != expected or (tp_size == 1 and list(ranks) != world_ranks):
        raise ValueError(
            f"the FSDP2 device mesh {shape} averages gradients over ranks {list(ranks)} but the world has {world} "
            f"processes ({expected} data-parallel x context-parallel ranks per tensor-parallel coordinate): "
            "gradients would not be reduced over every data-parallel x context-parallel rank (a mesh over "
            "the data-parallel ranks only leaves the CP ranks' gradients apart and their weights drift). "
            "Shard over all processes (fsdp full shard, the default mesh) or use HSDP with the mesh "
            "(replicate=dp_size, shard=cp_size), e.g. examples/finetune_llama_long.py --fsdp hybrid_shard"
        )
    return GradientReduction(HSDP if len(shape) == 2 else FSDP2, expected, shape)


def gradient_reduction(model: Any, *, fsdp_requested: bool = False, tp_size: int = 1) -> GradientReduction:
    """How ``model`` (as the training step sees it: wrapped) reduces gradients over the world.

    Args:
        model: the wrapped model: ``DistributedDataParallel``, an FSDP2 module (``fully_shard``),
            or the bare module in a one-process run.
        fsdp_requested: FSDP was asked for (TrainingArguments ``fsdp``, an Accelerate FSDP
            plugin or config); a model not sharded by FSDP2 is then refused.
        tp_size: tensor-parallel ranks (the mesh's ``"tp"`` dimension, over which FSDP2 does
            not reduce): the reduction group is then the world's dp x cp ranks, ``world / tp_size``.

    Raises:
        ValueError: the reduction group is not the whole world (a dp-only FSDP mesh, DDP over
            a subgroup, a multi-process model wrapped in nothing), or FSDP was requested and
            the model is not an FSDP2 module.
        NotImplementedError: FSDP1.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod  # torch_compile=True: Accelerate compiles the DDP / FSDP2 module it wrapped
    world, world_ranks = _world()
    if isinstance(model, torch.nn.Module):
        _refuse_fsdp1(model)
        fsdp_modules = _fsdp_modules(model)
        if fsdp_modules:
            # Between a forward and the next reshard, groups that keep their parameters
            # unsharded expose plain tensors; resharding (a no-op when sharded) shows the meshes.
            for module in fsdp_modules:
                module.reshard()
            return _fsdp2_reduction(model, world, world_ranks, tp_size)
    if tp_size > 1:
        raise NotImplementedError(
            f"a tensor-parallel model (tp_size={tp_size}) trains under context parallelism with FSDP2 over the "
            "dp x cp ranks only (transformers' DistributedConfig(tp_size=..., fsdp_size=<dp x cp>)); this one is "
            f"wrapped as {type(model).__name__}"
        )
    if fsdp_requested:
        raise ValueError(
            f"FSDP was requested but the model was wrapped as {type(model).__name__}, not sharded by FSDP2: "
            "a silent fallback to replicated weights. On CPU, accelerate drops FSDP unless hf_ring's patch is "
            "installed (RingTrainer installs it; in your own loop call "
            "hf_ring.patches.accelerate.enable_fsdp_on_cpu() before creating the Accelerator)"
        )
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        ranks = sorted(dist.get_process_group_ranks(model.process_group))
        if ranks != world_ranks:
            raise ValueError(
                f"DDP reduces gradients over ranks {ranks} but the world has {world} processes; wrap the "
                "model in DDP over the default group (every data-parallel x context-parallel rank)"
            )
        return GradientReduction(DDP, world)
    if world > 1:
        raise ValueError(
            f"the model ({type(model).__name__}) is not wrapped in DDP or FSDP2 in a world of {world} processes: "
            "nothing would reduce its gradients across ranks; prepare it with accelerator.prepare (the "
            "Trainer does)"
        )
    return GradientReduction(NONE, 1)


def fsdp_requested(args: Optional[Any], accelerator: Optional[Any]) -> bool:
    """Whether FSDP was asked for: TrainingArguments ``fsdp``, an Accelerator whose state keeps
    an FSDP plugin, or ``accelerate launch`` with an FSDP config (its environment)."""
    from hf_ring.patches.accelerate import fsdp_requested_by_environment

    if args is not None and getattr(args, "fsdp", None):
        return True
    state = getattr(accelerator, "state", None)
    if getattr(state, "fsdp_plugin", None) is not None:
        return True
    return fsdp_requested_by_environment()


def check_accelerate_parallelism(accelerator: Any) -> None:
    """Refuse Accelerate's own context / sequence parallelism next to hf_ring's."""
    config = getattr(accelerator, "parallelism_config", None)
    for name, what in (("cp_size", "context parallelism"), ("sp_size", "sequence parallelism (Ulysses)")):
        size = getattr(config, name, 1) or 1
        if size > 1:
            raise ValueError(
                f"the Accelerator's parallelism_config asks for its own {what} ({name}={size}); hf_ring brings "
                f"its own: give the CP size to RingAttentionPlugin, or the parallelism_config to a Ring trainer's "
                f"TrainingArguments (which hands Accelerate the config with {name} folded into dp_shard)"
            )


FSDP_MODES = ("full_shard", "hybrid_shard")


def fsdp_training_arguments(mode: Optional[str], cp_size: int, world_size: Optional[int] = None) -> dict[str, Any]:
    """``TrainingArguments`` keyword arguments for FSDP2 with context parallelism.

    Args:
        mode: None (no FSDP: DDP), ``"full_shard"`` (FSDP2 over every process: the default
            mesh) or ``"hybrid_shard"`` (HSDP: mesh ``(dp_size, cp_size)``, shard over the
            ranks of one CP group, which are consecutive, replicate over data-parallel ranks).
        cp_size: processes per context-parallel group.
        world_size: processes in the world (default: ``WORLD_SIZE`` set by the launcher).

    Checkpoints are sharded (``SHARDED_STATE_DICT``, torch.distributed.checkpoint);
    ``accelerate merge-weights`` consolidates one for a single process.
    """
    if mode is None:
        return {}
    if mode not in FSDP_MODES:
        raise ValueError(f"fsdp mode must be one of {FSDP_MODES} or None, got {mode!r}")
    import transformers

    if Version(transformers.__version__) < Version("5"):
        raise NotImplementedError(
            f"FSDP2 through TrainingArguments needs transformers >= 5 (installed {transformers.__version__}, whose "
            "fsdp_config has no FSDP version); upgrade transformers"
        )
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or world % cp_size != 0:
        raise ValueError(f"FSDP needs a world of several processes that cp_size={cp_size} divides; got {world}")
    kwargs: dict[str, Any] = {
        "fsdp": True,
        "fsdp_config": {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"},
    }
    dp_size = world // cp_size
    if mode == "hybrid_shard":
        if cp_size < 2 or dp_size < 2:
            raise ValueError(
                f"hybrid_shard shards over the CP group and replicates over dp ranks: it needs cp_size >= 2 and "
                f"dp_size >= 2 (got cp_size={cp_size}, dp_size={dp_size}); use full_shard"
            )
        from accelerate.parallelism_config import ParallelismConfig

        # Accelerate's mesh is (dp_replicate, dp_shard) in row-major rank order: the shard
        # dimension runs over consecutive ranks, which are one CP group.
        kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=dp_size, dp_shard_size=cp_size)
    return kwargs
