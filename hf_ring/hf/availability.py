"""Whether ``attn_implementation="ring_flash"`` is registered with the installed transformers,
and, when it could not be, the error that stopped it.

Why: ``import hf_ring`` registers ``ring_flash``, but the core (the ops, sharding, groups)
needs only torch. A missing transformers, one whose import fails, or a release whose
internals fail hf_ring's shape checks (``hf_ring.patches.transformers``) must not stop
``import hf_ring`` for a user of the core; instead ``ring_flash`` is refused when it is
asked for, naming the original error:

- transformers missing: nothing is registered and nothing is said;
- registration failed: one warning at import naming the error; ``ring_flash`` is then
  registered (through transformers' public attention and mask interfaces, where those
  still work) as a function that raises ``RingFlashUnavailable`` from the original error,
  and ``require`` (the transformers-dependent exports of ``hf_ring``) raises the same.
  On transformers 5, whose model creation takes any name containing "flash" for a Hub
  kernel unless hf_ring's patch is in place, a failed patch shows as transformers' own
  "Could not find ... flash attention implementation at `ring_flash`" after that warning.

Imports transformers only inside ``register_if_installed`` (what may be missing or broken).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

RING_FLASH = "ring_flash"

_attempted = False
_missing = False
_error: Optional[BaseException] = None


class RingFlashUnavailable(RuntimeError):
    """``ring_flash`` was asked for but could not be registered with the installed transformers."""


def _message(what: str) -> str:
    if _missing:
        return f"{what} needs transformers, which is not installed: `pip install \"transformers>=4.57,<6\"`"
    return (
        f"{what} needs attn_implementation={RING_FLASH!r}, whose registration with the installed transformers "
        f"failed at `import hf_ring`: {type(_error).__name__}: {_error}. `python -m hf_ring.env` shows the "
        "installed packages against the tested versions"
    )


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise RingFlashUnavailable(_message(f"attn_implementation={RING_FLASH!r}")) from _error


def _register_refusal() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(RING_FLASH, _refuse)
        AttentionMaskInterface.register(RING_FLASH, _refuse)
    except Exception:  # noqa: BLE001 - the warning already names the original error
        pass


def register_if_installed() -> None:
    """Register ``ring_flash`` when transformers is installed; idempotent. Never raises:
    a failure is kept for ``require`` and named in one warning."""
    global _attempted, _missing, _error
    if _attempted:
        return
    _attempted = True
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name == "transformers":
            _missing = True
            return
        _error = error
    except Exception as error:  # noqa: BLE001 - kept and re-raised by require()
        _error = error
    if _error is None:
        try:
            _register()
            return
        except Exception as error:  # noqa: BLE001 - kept and re-raised by require()
            _error = error
    _register_refusal()
    warnings.warn(_message(f"attn_implementation={RING_FLASH!r} (and RingTrainer, the TRL trainers)"),
                  stacklevel=3)


def _register() -> None:
    """Register ``ring_flash`` with transformers: the attention function
    (``AttentionInterface``), the mask builder (``AttentionMaskInterface``; without one
    transformers would pass no padding mask), and the version-specific patches
    (``hf_ring.patches.transformers``) that let the name load on transformers 5 and guard
    every model that asks for it. Idempotent. Imports transformers and the integration here,
    where a failure is kept (module docstring).

    Raises:
        hf_ring.patches.transformers.UnsupportedTransformersVersion: on a transformers
            release the patches were not written for.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from hf_ring.hf.attention import ring_flash_attention_forward
    from hf_ring.hf.mask import ring_flash_mask
    from hf_ring.hf.multimodal import guard_if_requested
    from hf_ring.hf.support import check_model_supported
    from hf_ring.patches import transformers as transformers_patches

    transformers_patches.apply(not_flash={RING_FLASH}, model_hook=guard_if_requested, init_hook=check_model_supported)
    AttentionInterface.register(RING_FLASH, ring_flash_attention_forward)
    AttentionMaskInterface.register(RING_FLASH, ring_flash_mask)


def registered() -> bool:
    """Whether ``ring_flash`` is registered (and the transformers integration usable)."""
    return _attempted and not _missing and _error is None


def describe() -> str:
    """One line for ``python -m hf_ring.env``."""
    if not _attempted:
        return "not attempted (hf_ring not imported)"
    if _missing:
        return "not registered: transformers is not installed"
    if _error is not None:
        return f"refused: {type(_error).__name__}: {_error}"
    return "registered"


def require(what: str) -> None:
    """Raise ``RingFlashUnavailable`` naming ``what`` and the original error unless
    ``ring_flash`` is registered."""
    if not registered():
        raise RingFlashUnavailable(_message(what)) from _error
