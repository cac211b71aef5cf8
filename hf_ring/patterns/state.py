"""The active context-parallel state: this process's groups on the N-D mesh (dp x cp x tp,
``hf_ring.distributed.mesh``) and what runs over them (layout, pattern, kernel), held in
one explicit object.

``setup_context_parallel`` builds the groups (``hf_ring.distributed.groups``) and makes
the state the *active* one; the ``ring_flash`` attention and the Accelerate plugin read
it. There is one active state per process, set once at start-up, never per batch.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Iterator, Mapping, Optional, Union

import torch.distributed as dist

from hf_ring.kernels.registry import registered_backends
from hf_ring.distributed.active import active_state, set_active_state
from hf_ring.distributed.groups import DEFAULT_CP_TIMEOUT, ProcessMesh, build_process_mesh, local_world_size
from hf_ring.distributed.mesh import ParallelDims
from hf_ring.patterns.auto import hybrid_sizes
from hf_ring.patterns.hybrid import HybridGroups, build_hybrid_groups
from hf_ring.patterns.plan import PATTERNS
from hf_ring.sharding.layouts import check_layout
from hf_ring.sharding.placement import check_placement_settings

# Process-group backend names: passed as backend= they meant the old argument, now dist_backend=.
_DIST_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "cpu:gloo,cuda:nccl")


@dataclass(frozen=True)
class AttentionSettings:
    """What runs over the CP group: the sequence layout, the pattern (and the hybrid
    pattern's Ulysses group size), the attention kernel, and where ``auto`` reads the node
    placement from. Validated on creation; the pattern against the CP size in
    :class:`ContextParallelState`."""

    layout: str = "zigzag"
    # hf_ring.context_parallel_attn_func's patterns, or "auto": chosen per model and
    # sequence (hf_ring/patterns/auto.py).
    pattern: str = "ring"
    ulysses_size: Optional[int] = None
    # "auto" (per layer, the first kernel that computes its features here) or a name from
    # hf_ring.kernels.available_backends.
    kernel: str = "auto"
    # Processes per node (LOCAL_WORLD_SIZE when launched by torchrun / accelerate).
    local_world_size: int = 1
    # Packed rows: "sharded" (every document over the group), "by_length" (short documents
    # whole on one rank: hf_ring/sharding/placement.py) or "auto" (whichever of the two
    # plans the ring's overhead makes cheaper, per row), with a bound on a rank's tokens.
    placement: str = "sharded"
    max_tokens_per_rank: Optional[int] = None

    def __post_init__(self) -> None:
        check_layout(self.layout)
        check_kernel_name(self.kernel)
        check_placement_settings(self.placement, self.max_tokens_per_rank, self.layout)
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")


@dataclass(frozen=True)
class ContextParallelState:
    """This process's place on the N-D mesh (``mesh``: its groups by axis name,
    ``hf_ring.distributed.groups.ProcessMesh``) and what runs over its CP group
    (``attention``), read once per forward by the guard. The properties name what the
    rest of hf_ring reads: ``cp_*`` (the sequence split), ``dp_*`` (``batch``: the ranks fed
    different batches), ``tp_*``, ``loss_group`` (the dp x cp ranks whose token counts add
    up; None: the whole world, which it is without TP)."""

    mesh: ProcessMesh
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    # The default process group the groups were built over: a state outlives neither a
    # destroyed nor a re-initialised one.
    world_group: Optional[dist.ProcessGroup] = field(default=None, compare=False, repr=False)
    # How long a collective of the CP group may wait for a peer before it fails.
    timeout: Optional[timedelta] = field(default=None, compare=False)
    # The process-group backend the groups were built with (None: the default group's).
    dist_backend: Optional[str] = field(default=None, compare=False)
    # The hybrid pattern's subgroups of the CP group by Ulysses group size, built up front
    # for the sizes the pattern can use (patterns/hybrid.py); a forward never builds one.
    hybrid: Mapping[int, HybridGroups] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_pattern(self.attention.pattern, self.attention.ulysses_size, self.cp_size)

    # ---- the mesh ----
    cp_group = property(lambda self: self.mesh.group("cp"))
    cp_rank = property(lambda self: self.mesh.rank("cp"))
    cp_size = property(lambda self: self.mesh.size("cp"))
    dp_group = property(lambda self: self.mesh.group("batch"))
    dp_rank = property(lambda self: self.mesh.rank("batch"))
    dp_size = property(lambda self: self.mesh.size("batch"))
    tp_group = property(lambda self: self.mesh.group("tp"))
    tp_rank = property(lambda self: self.mesh.rank("tp"))
    tp_size = property(lambda self: self.mesh.size("tp"))
    loss_group = property(lambda self: self.mesh.group("loss"))
    # The CP and TP groups' global ranks, in their axis's order.
    cp_ranks = property(lambda self: self.mesh.ranks("cp"))
    tp_ranks = property(lambda self: self.mesh.ranks("tp"))

    # ---- what runs over it ----
    layout = property(lambda self: self.attention.layout)
    pattern = property(lambda self: self.attention.pattern)
    ulysses_size = property(lambda self: self.attention.ulysses_size)
    kernel = property(lambda self: self.attention.kernel)
    local_world_size = property(lambda self: self.attention.local_world_size)
    placement = property(lambda self: self.attention.placement)
    max_tokens_per_rank = property(lambda self: self.attention.max_tokens_per_rank)

    @property
    def world_size(self) -> int:
        """Every process of the mesh."""
        return self.mesh.dims.world_size

    @property
    def loss_size(self) -> int:
        """The ranks whose token-loss shares add up to the step's: ``dp_size * cp_size``
        (TP ranks hold the same tokens)."""
        return self.mesh.size("loss")

    @property
    def first_rank(self) -> int:
        """The global rank of this CP group's first rank."""
        return self.cp_ranks[0]

    @property
    def cp_rank_stride(self) -> int:
        """How far apart the CP group's global ranks are (``tp_size``: TP is innermost)."""
        return self.tp_size

    def with_attention(self, **changes: object) -> "ContextParallelState":
        """The same groups with other attention settings (no collective)."""
        return replace(self, attention=replace(self.attention, **changes))


def check_pattern(pattern: str, ulysses_size: Optional[int], cp_size: int) -> None:
    """Refuse a pattern name or hybrid group size that cannot be used with ``cp_size``."""
    if pattern not in (*PATTERNS, "auto"):
        raise ValueError(f"unknown context-parallel pattern {pattern!r}; choose one of {', '.join(PATTERNS)} or 'auto'")
    if pattern == "hybrid":
        if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1 or (
                cp_size % ulysses_size):
            raise ValueError(
                f"pattern='hybrid' needs ulysses_size, a positive int dividing cp_size={cp_size} (Ulysses inside "
                f"groups of ulysses_size consecutive ranks, the ring across them), got {ulysses_size!r}"
            )
    elif ulysses_size is not None:
        raise ValueError(f"ulysses_size is for pattern='hybrid' only (got pattern={pattern!r}); 'auto' picks its own")


def check_kernel_name(backend: str) -> None:  # named backend= in the public functions' arguments
    """Refuse a kernel choice that is no name (the kernel itself is resolved per layer,
    where device and dtype are known); a process-group backend name is pointed to
    ``dist_backend=``."""
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend (the attention kernel) must be 'auto' or a kernel name, got {backend!r}")
    if backend.lower() in _DIST_BACKENDS:
        raise ValueError(
            f"backend={backend!r} is a process-group backend, but backend= names the attention kernel "
            "('auto' or one of hf_ring.kernels.available_backends(device, dtype)); pass the process-group "
            f"backend as dist_backend={backend!r}"
        )
    if backend != "auto" and backend not in registered_backends():
        raise ValueError(f"unknown attention backend {backend!r}; choose 'auto' or one of "
                         f"{sorted(registered_backends())}")


def setup_context_parallel(
    cp_size: int,
    *,
    layout: str = "zigzag",
    backend: str = "auto",
    dist_backend: Optional[str] = None,
    activate: bool = True,
    timeout: Union[None, timedelta, float] = None,
    pattern: str = "ring",
    ulysses_size: Optional[int] = None,
    tp_size: int = 1,
    placement: str = "sharded",
    max_tokens_per_rank: Optional[int] = None,
    pp_size: int = 1,
) -> ContextParallelState:
    """Build (or reuse) the dp x cp (x tp) groups over the initialised default process group.

    Args:
        cp_size: ranks per context-parallel group; ``cp_size * tp_size`` must divide the
            world size.
        layout: how sequences are split over the CP ranks (``"zigzag"``, ``"stripe"`` or
            ``"contiguous"``); ``ring_flash`` and the collator both follow it.
        backend: the attention kernel every ``ring_flash`` layer runs: ``"auto"`` (per
            layer, the first kernel of the registry's order that runs on the layer's device
            and dtype and computes its window and softcap) or a name from
            ``hf_ring.kernels.available_backends(device, dtype)`` (a layer whose features
            it lacks is refused, naming the kernels that have them).
        dist_backend: the process-group backend of the new groups (None: the default
            group's, or the active groups' when they are reused).
        activate: make the returned state the one ``ring_flash`` uses.
        timeout: how long a collective of the new groups waits for a peer before it fails,
            a ``datetime.timedelta`` or a number of seconds
            (gloo raises an error naming the cause; on NCCL the watchdog stops the process
            after hf_ring's message naming it, ``hf_ring.distributed.nccl_failures``). A CP
            group's ranks must run every forward together; one that does not is then an
            error within ``timeout``. None: the
            active groups' timeout when they are reused, else ``DEFAULT_CP_TIMEOUT`` (10
            minutes).
        pattern: how ``ring_flash`` splits attention across the CP group: ``"ring"``,
            ``"allgather"``, ``"ulysses"``, ``"hybrid"`` (see
            ``hf_ring.context_parallel_attn_func``) or ``"auto"`` (picked per model from
            head counts, sequence length, group size and placement, and features; logged).
        ulysses_size: ``pattern="hybrid"`` only: ranks per Ulysses group.
        tp_size: tensor-parallel ranks beside CP (a model loaded with transformers'
            ``DistributedConfig(tp_size=...)``): the mesh is ``dp, cp, tp`` with TP
            innermost, so every CP group holds ranks of one TP coordinate (the same heads);
            the data axis is what remains (``world / (cp_size * tp_size)``).
            A model loaded with ``DistributedConfig(tp_size=T, fsdp_size=world / T)``
            computes what one process computes, every pattern (tests/test_tp_cp.py,
            tests/test_nd_cp.py), and trains with ``RingTrainer`` and
            ``RingAttentionPlugin(cp_size=C, tp_size=T)`` (docs/parallelism.md).
        placement: packed rows only: ``"sharded"`` cuts every document over the CP group;
            ``"by_length"`` keeps short documents whole on one rank (no communication) and
            shards only the long ones, the ranks' work balanced; ``"auto"`` plans each row
            as ``"by_length"`` or as ``"sharded"``, whichever the cost model (with the ring's
            overhead) makes cheaper (``hf_ring.sharding.placement``; the collator must place
            alike: ``RingDataCollator.for_state``). Dense rows are refused under both.
        max_tokens_per_rank: ``"by_length"`` and ``"auto"`` only: the most tokens one rank may hold.
        pp_size: pipeline stages, the outermost mesh axis: every other group lies inside one
            stage, whose ranks are a whole dp x cp x tp block (``hf_ring.pipeline``).

    Every process of the world must call this with the same arguments (group creation is
    collective). Calling it again with the same ``cp_size`` over the same default group
    returns the active state (with the new layout, pattern and kernel); with another
    ``timeout`` or ``dist_backend``, or after the default group was destroyed and
    initialised again, new groups are built (both are fixed when a group is made; the
    previous state's groups stay usable).
    """
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    for name, size in (("tp_size", tp_size), ("pp_size", pp_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    timeout = as_timeout(timeout)
    check_layout(layout)
    check_pattern(pattern, ulysses_size, cp_size)
    check_kernel_name(backend)
    attention = AttentionSettings(layout, pattern, ulysses_size, backend, placement=placement,
                                  max_tokens_per_rank=max_tokens_per_rank)
    if not dist.is_available() or not dist.is_initialized():
        if cp_size == 1 and tp_size == 1 and pp_size == 1:
            state = ContextParallelState(ProcessMesh.single(), attention)
            if activate:
                set_active_state(state)
            return state
        raise RuntimeError(
            f"setup_context_parallel(cp_size={cp_size}, tp_size={tp_size}, pp_size={pp_size}) needs an initialised "
            "default process group: launch with `accelerate launch` or `torchrun` and call "
            "torch.distributed.init_process_group() (Accelerator() does it) first"
        )
    active = active_state()
    if (
        active is not None
        and active.cp_size == cp_size
        and active.tp_size == tp_size
        and active.mesh.dims.pp == pp_size
        and active.world_group is dist.group.WORLD
        and active.world_size == dist.get_world_size()
        and timeout in (None, active.timeout)
        and dist_backend in (None, active.dist_backend)
    ):
        if replace(active.attention, local_world_size=1) != attention:
            # Same groups, another layout, pattern or kernel: no collective needed.
            active = _with_hybrid_groups(active.with_attention(
                layout=layout, pattern=pattern, ulysses_size=ulysses_size, kernel=backend, placement=placement,
                max_tokens_per_rank=max_tokens_per_rank))
            if activate:
                set_active_state(active)
        return active
    world = dist.get_world_size()
    timeout = DEFAULT_CP_TIMEOUT if timeout is None else timeout
    mesh = build_process_mesh(ParallelDims(world, cp=cp_size, tp=tp_size, pp=pp_size), dist_backend, timeout)
    state = _with_hybrid_groups(
        ContextParallelState(mesh, replace(attention, local_world_size=local_world_size(world)),
                             world_group=dist.group.WORLD, timeout=timeout, dist_backend=dist_backend))
    if activate:
        set_active_state(state)
    return state


def _with_hybrid_groups(state: ContextParallelState) -> ContextParallelState:
    """``state`` holding the hybrid subgroups its pattern can use: ``"hybrid"``'s Ulysses group
    size, or every size ``"auto"`` may pick for a CP group spanning nodes. Collective over the
    whole default group when one is missing (as ``setup_context_parallel`` is)."""
    if state.pattern == "hybrid":
        sizes = [state.ulysses_size] if 1 < state.ulysses_size < state.cp_size else []
    elif state.pattern == "auto":
        sizes = hybrid_sizes(state.cp_size, state.local_world_size, state.first_rank, state.cp_rank_stride)
    else:
        sizes = []
    missing = [u for u in sizes if u not in state.hybrid]
    if state.pattern not in ("hybrid", "auto") or not (missing or state.cp_size < state.world_size):
        return state
    # Building is collective over the world: where there are several CP groups, one placed
    # across nodes may need sizes that this one does not, so every rank takes part (its own
    # list possibly empty) and the ranks build the union in one order.
    return replace(state, hybrid={**state.hybrid, **build_hybrid_groups(state.cp_group, missing)})


def as_timeout(timeout: Union[None, timedelta, float]) -> Optional[timedelta]:
    """``timeout`` as a timedelta: one given, or a positive number of seconds (None stays None)."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"timeout must be a positive datetime.timedelta or number of seconds (or None), "
                         f"got {timeout!r}")
    return timeout


def get_context_parallel_state() -> Optional[ContextParallelState]:
    """The active state, or None when ``setup_context_parallel`` was never called."""
    return active_state()


def set_context_parallel_state(state: Optional[ContextParallelState]) -> None:
    """Make ``state`` the active one (None deactivates context parallelism)."""
    set_active_state(state)


@contextlib.contextmanager
def context_parallel_suspended() -> Iterator[None]:
    """Run the block without context parallelism, then restore the active state (also on
    errors): ``ring_flash`` is exact local attention inside, so ``model.generate(...)`` on
    the full prompt works, on any rank or on every rank (nothing inside waits for the
    others). The model's weights must be whole there (not sharded by FSDP / ZeRO-3)."""
    previous = get_context_parallel_state()
    set_context_parallel_state(None)
    try:
        yield
    finally:
        set_context_parallel_state(previous)
