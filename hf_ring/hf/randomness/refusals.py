"""Where no random draw of a CP forward can match one process's, refused by name.

- :func:`draws_refused`: a caller that runs the model on rows laid out otherwise than one
  process lays them (hf_ring's TRL forwards: rollout rows compacted, rows padded to the CP
  multiple, rows packed) says so; the guard hands the reason to the forward's
  :class:`~hf_ring.hf.randomness.draws.OneProcessDraws`, which refuses a sharded draw with it.
- :class:`NoDraws`: refuses every draw while in force, for code that runs a different share
  of the work on every rank (the split vision tower).
- :func:`refuse_length_scaled_noise`: NEFTune, whose noise is scaled by the shard's length.

Part of the transformers integration; uses no transformers API. Must not import the Trainer,
TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Optional

from torch.overrides import TorchFunctionMode

from hf_ring.hf.randomness.ops import DROPOUTS, RANDOM_OPS, WHAT_TO_DO, caller, dropout_flags, op_name

# Set by a caller that runs the model on rows laid out otherwise than one process lays them
# (TRL's rollout rows compacted, rows padded to the CP multiple): the guard hands it to the
# forward's draws, which refuse a sharded draw with it rather than draw another mask.
_REFUSAL: ContextVar[Optional[str]] = ContextVar("hf_ring_draws_refused", default=None)


@contextmanager
def draws_refused(reason: str) -> Iterator[None]:
    """Inside this block, a CP forward's random draw on a sharded tensor is refused with
    ``reason`` (why no draw there matches one process's), not made."""
    token = _REFUSAL.set(reason)
    try:
        yield
    finally:
        _REFUSAL.reset(token)


def current_refusal() -> Optional[str]:
    """The reason set by the innermost :func:`draws_refused` block, or None."""
    return _REFUSAL.get()


class NoDraws(TorchFunctionMode):
    """Refuses every random draw while in force: for code that runs a different share of the
    work on every rank (the split vision tower, multimodal/tower.py), where no full shape
    exists to draw from.

    Args:
        where: what runs, for the error ("Qwen2_5_VisionTransformerPretrainedModel, whose
            images hf_ring splits over the CP group").
    """

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RANDOM_OPS:
            drawing = True
            if func in DROPOUTS:
                _, p, training, _ = dropout_flags(func, args, kwargs)
                drawing = training and p > 0.0
            if drawing:
                raise NotImplementedError(
                    f"{op_name(func)} draws random numbers in {self.where}, called from {caller()}: each rank "
                    f"runs its own share there, so no draw matches one process's. {WHAT_TO_DO}"
                )
        return func(*args, **kwargs)


def refuse_length_scaled_noise(model: Any, cp_size: int) -> None:
    """NEFTune (the Trainer's and TRL's ``neftune_noise_alpha``) adds uniform noise to the
    input embeddings of magnitude ``alpha / sqrt(seq_len * hidden)``, the length read from the
    embeddings' output: under CP this rank's shard, so the noise would be ``sqrt(cp_size)``
    times one process's. Refused on every rank (the setting is the same on each)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    alpha = getattr(embeddings, "neftune_noise_alpha", None)
    if alpha:
        raise NotImplementedError(
            f"NEFTune (neftune_noise_alpha={alpha}) scales its embedding noise by the sequence length its "
            f"hook reads from the embeddings, which under context parallelism (cp_size={cp_size}) is this "
            f"rank's shard: the noise would be sqrt({cp_size}) times one process's. Train without "
            "neftune_noise_alpha under context parallelism"
        )
