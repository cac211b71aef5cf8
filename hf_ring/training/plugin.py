"""Accelerate integration: the dp x cp process groups and data sharded over data-parallel ranks.

Under context parallelism the ``cp_size`` ranks of one CP group work on the SAME batch
(each on its shard of the sequence), so the data loader must hand out batches per
data-parallel rank, not per process. Accelerate's own ``prepare_data_loader`` already
knows how to give each of ``num_processes`` processes its share (samplers, seeding,
even batches, resuming with ``skip_first_batches``); the plugin calls it with
``num_processes=dp_size, process_index=dp_rank`` instead of the world's, and installs that
on the Accelerator so that ``accelerator.prepare(dataloader)`` (the HF Trainer's path too)
does it. Both go through :mod:`hf_ring.patches.accelerate`, the one module that knows
Accelerate's internals (and the versions it knows them for).

Usage in a custom loop::

    accelerator = Accelerator()
    plugin = hf_ring.RingAttentionPlugin(cp_size=4)
    state = plugin.attach(accelerator)      # builds the groups, hooks prepare()
    collator = plugin.make_collator(pad_token_id=tok.pad_token_id)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(ds, collate_fn=collator))

and compute the loss with :mod:`hf_ring.training.loss` (``scale_for_ddp`` with
``plugin.world_size``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from hf_ring.training.collator import RingDataCollator
from hf_ring.training.loss import all_reduce_sum
from hf_ring.training.vision.collator import RingVisionDataCollator
from hf_ring.patches import accelerate as accelerate_patches
from hf_ring.patterns.state import (AttentionSettings, ContextParallelState, as_timeout, check_kernel_name, check_pattern,
                                    setup_context_parallel)
from hf_ring.sharding.layouts import check_layout

if TYPE_CHECKING:  # the memory layer's config, imported where the pipeline is built
    from hf_ring.memory.chunked_loss import ChunkedLossConfig


def _ensure_process_group() -> None:
    """Initialise the default process group the way Accelerate does (gloo on CPU, NCCL on GPU)."""
    if dist.is_available() and dist.is_initialized():
        return
    from accelerate import PartialState

    PartialState(cpu=not torch.cuda.is_available())


@dataclass
class RingAttentionPlugin:
    """Context parallelism for Accelerate.

    Attributes:
        cp_size: processes per context-parallel group (the sequence is split ``cp_size``
            ways); ``cp_size * tp_size`` must divide the number of processes. Without TP the
            groups are consecutive global ranks.
        tp_size: tensor-parallel ranks of a model loaded with transformers'
            ``DistributedConfig(tp_size=tp_size, fsdp_size=<dp x cp>)``: TP is the innermost
            mesh axis, so each CP group holds ranks of one TP coordinate, ``tp_size`` apart
            (``hf_ring.distributed.mesh``); every rank of a TP x CP block gets the same batch.
        layout: the sequence layout, ``"zigzag"`` (default), ``"stripe"`` or ``"contiguous"``;
            the collator and the attention must use the same.
        pattern: how attention is split across a CP group: ``"ring"`` (default),
            ``"allgather"``, ``"ulysses"``, ``"hybrid"`` or ``"auto"`` (picked per model
            and sequence, logged); see ``hf_ring.context_parallel_attn_func``.
        ulysses_size: ``pattern="hybrid"`` only: ranks per Ulysses group.
        backend: the attention kernel: ``"auto"`` (default; per attention layer, the first
            kernel of ``hf_ring.kernels``' order that runs on the layer's device and dtype
            and computes its sliding window and softcap) or a name from
            ``hf_ring.kernels.available_backends(device, dtype)``, which a layer whose
            features it lacks refuses, naming the kernels that have them.
        timeout: how long a collective of the CP group waits for a peer before it fails
            with hf_ring's message (a rank that stopped, or ranks that did not run the same
            forward): seconds or a ``datetime.timedelta``; None: 10 minutes
            (``setup_context_parallel``'s ``timeout``). Raise it where a rank may be slow
            for long, e.g. the main process saving a large checkpoint while the others wait.
        placement: packed rows: ``"sharded"`` (default: every document cut over the CP
            group), ``"by_length"`` (short documents whole on one rank, long ones sharded,
            the ranks' work balanced) or ``"auto"`` (per row, whichever of the two the cost
            model, the ring's overhead included, makes cheaper; docs/packed.md).
            ``make_collator`` places alike.
        max_tokens_per_rank: ``"by_length"`` and ``"auto"`` only: the most tokens one rank may hold.
        pp_size: pipeline stages, the outermost mesh axis (each stage's ranks a whole
            dp x cp x tp block with its own CP and TP groups); ``cp_size * tp_size * pp_size``
            must divide the processes. Trained by ``RingTrainer`` (its steps through the
            schedule) or by :meth:`make_pipeline`'s runner in your own loop; the TRL trainers
            refuse ``pp_size > 1`` (docs/parallelism.md).
        pp_schedule: PyTorch's schedule name (``hf_ring.pipeline.SCHEDULES``: ``"GPipe"``,
            ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"``).
        pp_microbatches: micro-batches per step (they must split the step's batch evenly).
        pp_fsdp: FSDP2 inside each stage: its weights sharded over the stage's own dp x cp
            ranks (``hf_ring.pipeline.fsdp``), the gradients reduce-scattered as sums. Not
            TrainingArguments' ``fsdp``, whose mesh is the whole world (refused under PP).
    """

    cp_size: int = 1
    tp_size: int = 1
    layout: str = "zigzag"
    pattern: str = "ring"
    ulysses_size: Optional[int] = None
    backend: str = "auto"
    timeout: Optional[float | timedelta] = None
    placement: str = "sharded"
    max_tokens_per_rank: Optional[int] = None
    pp_size: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 1
    pp_fsdp: bool = False

    def __post_init__(self) -> None:
        for name in ("cp_size", "tp_size", "pp_size", "pp_microbatches"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        check_layout(self.layout)
        check_pattern(self.pattern, self.ulysses_size, self.cp_size)
        check_kernel_name(self.backend)
        AttentionSettings(self.layout, placement=self.placement, max_tokens_per_rank=self.max_tokens_per_rank)
        self.timeout = as_timeout(self.timeout)
        from hf_ring.pipeline.schedule import schedule_class  # torch only; the stages need transformers

        schedule_class(self.pp_schedule)
        if not isinstance(self.pp_fsdp, bool) or (self.pp_fsdp and self.pp_size == 1):
            raise ValueError(f"pp_fsdp={self.pp_fsdp!r} shards the weights inside pipeline stages: a bool, True only "
                             "with pp_size > 1 (without PP, FSDP2 comes from TrainingArguments' fsdp)")
        if self.pp_fsdp:
            from hf_ring.pipeline.fsdp import check_fsdp_schedule

            check_fsdp_schedule(self.pp_schedule)
        self._state: Optional[ContextParallelState] = None

    @classmethod
    def from_parallelism_config(cls, config: Any, **settings: Any) -> "RingAttentionPlugin":
        """The plugin for Accelerate's ``ParallelismConfig``: its ``cp_size`` and ``tp_size``
        (checked: no ``sp_size``, no torch-only CP settings), and ``settings`` (layout,
        pattern, ulysses_size, backend, timeout) for what the config does not say. Its data
        axes are what remains of the world (``dp_replicate x dp_shard``)."""
        from hf_ring.training.parallelism_config import plugin_sizes

        cp_size, tp_size = plugin_sizes(config)
        return cls(cp_size=cp_size, tp_size=tp_size, **settings)

    # ---- groups ----

    def setup(self) -> ContextParallelState:
        """Build (once) the dp x cp groups over the default process group and make them active.

        Initialises the default group through Accelerate's ``PartialState`` when nothing did
        yet. Collective: every process must call it.
        """
        if self._state is not None:
            return self._state
        _ensure_process_group()
        world = dist.get_world_size() if dist.is_initialized() else 1
        block = self.cp_size * self.tp_size * self.pp_size
        if world % block != 0:
            hint = ""
            if world == 1:
                hint = (
                    " Only one process is running. On a machine without GPUs `accelerate launch "
                    "--num_processes N` starts a single process unless --multi_gpu is also given "
                    "(it then starts N processes with torchrun and hf_ring uses gloo); `torchrun "
                    "--nproc_per_node N` works too."
                )
            what = f"cp_size={self.cp_size}" + (f" x tp_size={self.tp_size}" if self.tp_size > 1 else "") + (
                f" x pp_size={self.pp_size}" if self.pp_size > 1 else "")
            raise ValueError(f"{what} needs a multiple of {block} processes, but the world has {world}.{hint}")
        # ring_flash shards in the state's layout; make_collator cuts sequences the same way.
        self._state = setup_context_parallel(self.cp_size, tp_size=self.tp_size, layout=self.layout,
                                             pattern=self.pattern,
                                             ulysses_size=self.ulysses_size, backend=self.backend,
                                             timeout=self.timeout, placement=self.placement,
                                             max_tokens_per_rank=self.max_tokens_per_rank, pp_size=self.pp_size)
        if importlib.util.find_spec("transformers") is not None:
            # DeepSpeed configs reach hf_ring through transformers. Before the model exists:
            # ZeRO-3 partitions it as it is created, over DeepSpeed's world.
            from hf_ring.training import deepspeed_support

            deepspeed_support.configure(self._state)
        return self._state

    @property
    def state(self) -> ContextParallelState:
        if self._state is None:
            raise RuntimeError("call RingAttentionPlugin.setup() (or attach()) first")
        return self._state

    @property
    def world_size(self) -> int:
        """All processes, ``dp_size * cp_size * tp_size``."""
        return self.state.world_size

    def describe(self) -> str:
        """One line about this process's place in the dp x cp grid."""
        s = self.state
        rank = dist.get_rank() if dist.is_initialized() else 0
        dist_backend = dist.get_backend() if dist.is_initialized() else "none"
        return (
            f"rank {rank}/{s.world_size} (dist_backend {dist_backend}): dp_rank {s.dp_rank}/{s.dp_size}, "
            f"cp_rank {s.cp_rank}/{s.cp_size}, " + (f"tp_rank {s.tp_rank}/{s.tp_size}, " if s.tp_size > 1 else "")
            + (f"pp_rank {s.mesh.rank('pp')}/{s.mesh.size('pp')}, " if s.mesh.size("pp") > 1 else "")
            + f"layout {s.layout}, pattern {s.pattern}"
            + (f" (ulysses_size {s.ulysses_size})" if s.ulysses_size else "") + f", kernel {s.kernel}"
            + (f", placement {s.placement}" if s.placement != "sharded" else "")
        )

    def make_pipeline(self, model: Any, stages_per_rank: Optional[int] = None,
                      pp_layers: Optional[list[int]] = None,
                      chunked_loss: Optional[ChunkedLossConfig] = None) -> Any:
        """This rank's stages of ``model`` (pruned to them) and the schedule that trains them
        (``hf_ring.pipeline.PipelineRunner``): ``pp_schedule``, ``pp_microbatches``; with
        ``pp_fsdp`` each stage sharded over its dp x cp ranks (``hf_ring.pipeline.fsdp``).
        ``chunked_loss``: compute the last stage's loss by chunks, as configured (None: from
        its logits)."""
        from hf_ring.pipeline import PipelineRunner

        runner = PipelineRunner(model, self.setup(), self.pp_schedule, self.pp_microbatches, stages_per_rank, pp_layers,
                                chunked_loss)
        if self.pp_fsdp:
            from hf_ring.pipeline.fsdp import shard_stages

            shard_stages(runner.stages, self._state)
        return runner

    # ---- data ----

    def make_collator(self, pad_token_id: int, **kwargs: Any) -> RingDataCollator:
        """A :class:`RingDataCollator` built from the context-parallel state (CP size, rank and
        layout), which owns them; with ``pp_size > 1`` one that packs each of the
        ``pp_microbatches`` micro-batches into its own row (``hf_ring.training.pp.collator``)."""
        s = self.setup()
        if self.pp_size > 1:
            from hf_ring.training.pp.collator import PipelineDataCollator

            return PipelineDataCollator.for_state(s, pad_token_id, micro_batches=self.pp_microbatches, **kwargs)
        return RingDataCollator.for_state(s, pad_token_id, **kwargs)

    def make_vision_collator(self, pad_token_id: int, image_token_id: int, **kwargs: Any) -> RingVisionDataCollator:
        """A :class:`RingVisionDataCollator` for image-text rows (the full batch on every rank,
        the labels sharded) built from the context-parallel state."""
        s = self.setup()
        return RingVisionDataCollator.for_state(s, pad_token_id, image_token_id, **kwargs)

    def attach(self, accelerator: Any) -> ContextParallelState:
        """Set up the groups and make ``accelerator.prepare`` shard data loaders over the
        data-parallel ranks only (every rank of a CP group then gets the same batches)."""
        state = self.setup()
        if accelerator.num_processes != state.world_size:
            # The usual cause on a machine without a GPU: transformers' TrainingArguments build
            # their Accelerator for one process there unless use_cpu=True, even under torchrun.
            cpu_hint = ("; on a machine without GPUs pass TrainingArguments(use_cpu=True): without it "
                        "transformers runs one process there, whatever the launcher started"
                        if accelerator.num_processes == 1 and not torch.cuda.is_available() else "")
            raise RuntimeError(
                f"the Accelerator sees {accelerator.num_processes} processes but the default process "
                f"group has {state.world_size}; create the Accelerator in the launched processes{cpu_hint}"
            )
        accelerate_patches.install_prepare_data_loader(
            accelerator,
            lambda data_loader, device_placement, slice_fn: self.prepare_data_loader(
                accelerator, data_loader, device_placement, slice_fn
            ),
        )
        accelerator.ring_attention_plugin = self
        return state

    def prepare_data_loader(
        self,
        accelerator: Any,
        data_loader: torch.utils.data.DataLoader,
        device_placement: Optional[bool] = None,
        slice_fn_for_dispatch: Any = None,
    ) -> torch.utils.data.DataLoader:
        """Accelerate's ``prepare_data_loader`` with the data-parallel coordinates."""
        if accelerator.dispatch_batches:
            raise NotImplementedError(
                "dispatch_batches=True sends slices of one batch to every process, but under context "
                "parallelism all ranks of a CP group need the same whole batch; set "
                "dispatch_batches=False in the Accelerator's DataLoaderConfiguration (the Trainer's "
                "accelerator_config)"
            )
        state = self.state
        return accelerate_patches.prepare_data_loader(
            accelerator,
            data_loader,
            num_processes=state.dp_size,
            process_index=state.dp_rank,
            device_placement=device_placement,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
        )

    # ---- loss ----

    def global_token_count(self, local_count: torch.Tensor) -> torch.Tensor:
        """Valid tokens summed over the dp x cp ranks (the state's loss group: TP ranks hold the
        same tokens and are not counted twice; collective over the world)."""
        return all_reduce_sum(local_count, group=self.state.loss_group)
