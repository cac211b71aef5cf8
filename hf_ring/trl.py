"""``hf_ring.trl``: TRL's SFT, DPO, GRPO and RLOO trainers with context parallelism (``pip install hf_ring[trl]``).

The public face of :mod:`hf_ring.training.trl`; importing it checks the installed TRL and
transformers (see there). Kept apart from ``import hf_ring`` so that the core and the
Trainer work without TRL installed.
"""

from hf_ring.training.trl import RingDPOTrainer, RingGRPOTrainer, RingRLOOTrainer, RingSFTCollator, RingSFTTrainer

__all__ = ["RingDPOTrainer", "RingGRPOTrainer", "RingRLOOTrainer", "RingSFTCollator", "RingSFTTrainer"]
