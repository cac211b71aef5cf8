"""Accelerate's ``ParallelismConfig`` as an entry point to hf_ring's context parallelism.

A user who writes the Hugging Face way sets ``TrainingArguments(parallelism_config=
ParallelismConfig(cp_size=C, tp_size=T, dp_shard_size=S, dp_replicate_size=R))``, or
launches with ``accelerate launch --use_parallelism_config --parallelism_config_cp_size C``
(which exports ``PARALLELISM_CONFIG_*``, read by ``ParallelismConfig()``). Given to the
stock Trainer, ``cp_size`` engages torch's context parallelism (SDPA only, FSDP2 required,
refused on CPU). Given to a Ring trainer it means hf_ring's: the plugin is built with that
``cp_size`` and ``tp_size``, and Accelerate is handed the same mesh with the CP axis folded
into ``dp_shard`` (:func:`accelerate_view`), so it never engages torch's.

Folding keeps every rank where it was. Accelerate's mesh is ``(dp_replicate, dp_shard, cp,
tp)``, hf_ring's ``(dp_replicate, dp_shard, cp, tp)`` too (``hf_ring.distributed.mesh``): a
rank's index is the same with ``dp_shard x cp`` read as one axis, and that axis is what
FSDP2 shards over in both (``dp_shard_cp`` in Accelerate, ``fsdp`` in hf_ring). Without
FSDP and without TP or HSDP, Accelerate gets no config at all: DDP over the world, as a
Ring trainer runs without one.

Must not import hf_ring's integration (``hf_ring.hf``) or trainer modules.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

_ENV_FLAG = "ACCELERATE_USE_PARALLELISM_CONFIG"
_TORCH_CP_DEFAULT_STRATEGY = "allgather"


def requested_parallelism_config(training_args: Optional[Any]) -> Optional[Any]:
    """The ``ParallelismConfig`` the run asks for: ``training_args.parallelism_config``, else
    the one ``accelerate launch --use_parallelism_config`` describes in the environment
    (what the Accelerator would build itself), else None."""
    config = getattr(training_args, "parallelism_config", None)
    if config is not None:
        return config
    if os.environ.get(_ENV_FLAG, "").lower() != "true":  # what the Accelerator itself reads
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()


def asks_for_sizes(config: Optional[Any]) -> bool:
    """Whether ``config`` sizes hf_ring's axes (``cp_size`` or ``tp_size`` above 1). One that
    lays out data axes only (hf_ring's own HSDP config, ``fsdp_training_arguments``) does not."""
    return config is not None and ((config.cp_size or 1) > 1 or (config.tp_size or 1) > 1)


def check_for_hf_ring(config: Any) -> None:
    """Refuse what of ``config`` hf_ring does not take over.

    Raises:
        ValueError: ``sp_size > 1`` (DeepSpeed's Ulysses would split the sequence a second
            time), or a torch context-parallel setting that only torch's CP reads
            (``cp_handler.cp_comm_strategy`` other than its default).
    """
    if (getattr(config, "sp_size", 1) or 1) > 1:
        raise ValueError(
            f"parallelism_config asks for DeepSpeed's sequence parallelism (sp_size={config.sp_size}) with hf_ring's "
            "context parallelism: it would split the sequence a second time. Set sp_size=1 and cp_size to the "
            "sequence split; hf_ring's Ulysses is RingAttentionPlugin(pattern='ulysses')")
    strategy = getattr(getattr(config, "cp_handler", None), "cp_comm_strategy", _TORCH_CP_DEFAULT_STRATEGY)
    if (config.cp_size or 1) > 1 and strategy != _TORCH_CP_DEFAULT_STRATEGY:
        raise ValueError(
            f"parallelism_config's cp_handler asks for torch's context parallelism with cp_comm_strategy="
            f"{strategy!r}, but a Ring trainer runs hf_ring's in its place, which does not read it. Choose hf_ring's "
            "pattern instead: RingAttentionPlugin(cp_size=..., pattern='ring' | 'allgather' | 'ulysses' | 'hybrid' | "
            "'auto'), and leave cp_handler unset")


def plugin_sizes(config: Any) -> tuple[int, int]:
    """``(cp_size, tp_size)`` of ``config``, checked (:func:`check_for_hf_ring`)."""
    check_for_hf_ring(config)
    return int(config.cp_size or 1), int(config.tp_size or 1)


def check_fills_world(config: Any, world: int) -> None:
    """Refuse a config whose axes do not fill the world (the Accelerator refuses it too; folded
    into no config at all, it would run with other data-parallel sizes than it says)."""
    sizes = {a: int(getattr(config, f"{a}_size") or 1) for a in ("dp_replicate", "dp_shard", "cp", "tp")}
    total = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"]
    if total != world:
        shown = " x ".join(f"{a} {n}" for a, n in sizes.items())
        raise ValueError(f"parallelism_config lays out {shown} = {total} processes but the world has {world}; "
                         "the sizes must fill it (dp_shard_size: the data-parallel ranks left over)")


def check_plugin_agrees(config: Any, cp_size: int, tp_size: int) -> None:
    """Refuse a ``RingAttentionPlugin`` whose sizes are not those of ``config``."""
    want = plugin_sizes(config)
    if want != (cp_size, tp_size):
        raise ValueError(
            f"parallelism_config says cp_size={want[0]}, tp_size={want[1]} but ring_plugin says cp_size={cp_size}, "
            f"tp_size={tp_size}; give the sizes once (parallelism_config alone builds the plugin, with "
            "RingAttentionPlugin.from_parallelism_config), or make them agree")


def accelerate_view(config: Optional[Any], fsdp: bool, sharded_at_load: bool = False) -> Optional[Any]:
    """The config Accelerate gets under hf_ring's CP: ``config`` with ``cp`` folded into
    ``dp_shard`` (the same ranks, see the module docstring), never torch's CP; None where
    nothing is left for Accelerate to lay out (no FSDP, no TP, no replicas): DDP over the
    world. For a model transformers sharded at load (``sharded_at_load``: its own
    ``DistributedConfig``), the replicas are folded in too: the Trainer then sets
    ``dp_shard_size`` to the model's data-parallel size, replicas included, and a separate
    ``dp_replicate`` would count them twice. ``config`` itself is not changed."""
    if config is None:
        return None
    cp = int(config.cp_size or 1)
    if cp == 1:
        return config
    replicas, tp = int(config.dp_replicate_size or 1), int(config.tp_size or 1)
    if not fsdp and tp == 1 and replicas == 1:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    shard = int(config.dp_shard_size or 1) * cp
    if sharded_at_load:
        shard, replicas = shard * replicas, 1
    return ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shard, tp_size=tp, cp_size=1, sp_size=1,
                             tp_handler=config.tp_handler)


@contextlib.contextmanager
def given_to_accelerate(training_args: Any, view: Optional[Any]) -> Iterator[None]:
    """Inside, ``training_args.parallelism_config`` is ``view`` and accelerate launch's
    request to build a config from the environment is off; both restored after."""
    saved_config, saved_flag = training_args.parallelism_config, os.environ.pop(_ENV_FLAG, None)
    training_args.parallelism_config = view
    try:
        yield
    finally:
        training_args.parallelism_config = saved_config
        if saved_flag is not None:
            os.environ[_ENV_FLAG] = saved_flag


__all__ = ["accelerate_view", "asks_for_sizes", "check_fills_world", "check_for_hf_ring", "check_plugin_agrees",
           "given_to_accelerate",
           "plugin_sizes", "requested_parallelism_config"]
