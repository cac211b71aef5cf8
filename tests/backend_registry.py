"""Attention backends registered for a block only: a test's stand-in kernels must not be
found by the next case, which in a live world (tests/worlds.py) runs in the same process
(the world fails a case that leaves one registered).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from hf_ring.kernels import AttentionBackend, register_backend, registry


@contextlib.contextmanager
def registered(*backends: AttentionBackend) -> Iterator[None]:
    """``backends`` registered for the block, the registry as it was afterwards (a live
    world's rank runs other cases next, which must not find them)."""
    before = dict(registry._REGISTERED)
    try:
        for backend in backends:
            register_backend(backend)
        yield
    finally:
        registry._REGISTERED.clear()
        registry._REGISTERED.update(before)
