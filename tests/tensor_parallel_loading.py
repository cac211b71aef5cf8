"""Whether transformers can load a model tensor-parallel for the tests of TP beside CP.

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))``
is transformers 5.x's; 4.57's ``DistributedConfig`` takes neither size. One check for every
test that needs it (the example says the same at its ``--tp_size``).
"""

from __future__ import annotations

import dataclasses

import pytest


def _available() -> bool:
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return {"tp_size", "fsdp_size"} <= {f.name for f in dataclasses.fields(DistributedConfig)}


AVAILABLE = _available()
NEEDS_TP = pytest.mark.skipif(not AVAILABLE, reason="transformers' DistributedConfig(tp_size, fsdp_size) is 5.x only")
