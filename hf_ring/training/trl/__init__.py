"""``hf_ring.training.trl`` (public as ``hf_ring.trl``): TRL's SFT, DPO, GRPO and RLOO trainers with context parallelism (``pip install hf_ring[trl]``).

``RingSFTTrainer``, ``RingDPOTrainer``, ``RingGRPOTrainer`` and ``RingRLOOTrainer`` are drop-in for
``trl.SFTTrainer``, ``trl.DPOTrainer``, ``trl.GRPOTrainer`` and ``trl.RLOOTrainer`` with one more argument, ``ring_plugin`` (a
:class:`~hf_ring.RingAttentionPlugin`). Importing this package checks the installed TRL
and transformers first: TRL's private internals are read through
:mod:`hf_ring.patches.trl`, written for specific TRL releases, and the Trainer reads
``loss_is_scaled_for_ga`` (how these trainers say whether their loss is already
normalised for gradient accumulation) only from transformers 5.19 on.

The only package of hf_ring that imports TRL; every other one must not import it (nor
this package), so that hf_ring works without TRL installed.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

from hf_ring.patches import trl as _trl_patches

_trl_patches.check_version()
_OLDEST_TRANSFORMERS = Version("5.19.0")
if Version(transformers.__version__) < _OLDEST_TRANSFORMERS:
    raise ImportError(
        f"hf_ring.trl needs transformers >= {_OLDEST_TRANSFORMERS} (the Trainer reads loss_is_scaled_for_ga from "
        f"then on), found {transformers.__version__}; upgrade transformers (e.g. `pip install transformers==5.24.0`)"
    )

from hf_ring.training.trl.dpo import RingDPOTrainer  # noqa: E402
from hf_ring.training.trl.grpo import RingGRPOTrainer  # noqa: E402
from hf_ring.training.trl.rloo import RingRLOOTrainer  # noqa: E402
from hf_ring.training.trl.sft import RingSFTTrainer  # noqa: E402
from hf_ring.training.trl.sft_collator import RingSFTCollator  # noqa: E402

__all__ = ["RingDPOTrainer", "RingGRPOTrainer", "RingRLOOTrainer", "RingSFTCollator", "RingSFTTrainer"]
