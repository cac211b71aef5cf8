"""Registers ``attn_implementation="ring_flash"`` with transformers; run by ``import hf_ring``.

Three pieces: the attention function (``AttentionInterface``), the mask builder
(``AttentionMaskInterface``; without one transformers would pass no padding mask), and the
version-specific patches (``hf_ring.patches.transformers``) that let the name load on
transformers 5 and guard every model that asks for it. Idempotent.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hf_ring.hf.attention import ring_flash_attention_forward
from hf_ring.hf.multimodal import guard_if_requested
from hf_ring.hf.support import RING_FLASH, check_model_supported
from hf_ring.hf.mask import ring_flash_mask
from hf_ring.patches import transformers as transformers_patches


def register() -> None:
    """Register ``ring_flash`` and apply the transformers patches.

    Raises:
        hf_ring.patches.transformers.UnsupportedTransformersVersion: on a transformers
            release the patches were not written for.
    """
    transformers_patches.apply(not_flash={RING_FLASH}, model_hook=guard_if_requested, init_hook=check_model_supported)
    AttentionInterface.register(RING_FLASH, ring_flash_attention_forward)
    AttentionMaskInterface.register(RING_FLASH, ring_flash_mask)
