import os
import sys

import pytest

# Lets test modules import tests/distributed.py as a plain module.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def own_registry(monkeypatch):
    """A copy of the attention-backend registry that this test may change."""
    from hf_ring.kernels import registry

    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))
