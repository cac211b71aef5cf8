"""Whether transformers can load a model tensor-parallel for the tests of TP beside CP.

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))``
is transformers 5.x's; 4.57's ``DistributedConfig`` takes neither size. The check is
``hf_ring.patches.transformers.distributed_config_takes_sizes``, which the example's
``--tp_size`` reads too; this module gives the tests its marker.
"""

from __future__ import annotations

import pytest

from hf_ring.patches.transformers import distributed_config_takes_sizes

AVAILABLE = distributed_config_takes_sizes()
NEEDS_TP = pytest.mark.skipif(not AVAILABLE, reason="transformers' DistributedConfig(tp_size, fsdp_size) is 5.x only")
