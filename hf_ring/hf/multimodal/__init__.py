"""Image-text models under context parallelism (issue 21): every rank of a CP group holds the
same full batch; the model's own code runs on it up to its language model (token
embeddings, the vision tower, the merge of image features into the placeholders, its own
positions, Qwen's 3-D M-RoPE included); at the language model's entry hf_ring shards the
merged embeddings, the positions and the family's other per-token inputs in the state's
layout (``shard.py``), and the language model runs under the ring guard as a text model.
Logits come out sharded like the tokens. ``families.py`` lists the families whose merge and
positions were read and tested (Gemma 3's and PaliGemma's bidirectional spans, read from
``token_type_ids`` and computed in the ring), and refuses the others by name; ``setup.py``
puts the hooks on a model. Packed rows of image-text samples are cut
document by document at the same entry (``shard.py``), each document numbered as the model
numbers it alone (``positions.py``, the model's own position code per document).

The entry points replace the text guard's for every model: :func:`guard_if_requested` (the
transformers patch hook) and :func:`guard_model` (by hand) set an image-text model up here
and hand a text model to ``hf_ring.hf.guard``.

Part of the transformers integration, above the guard (which must not import this package).
Must not import the Trainer, TRL, or hf_ring's training and memory layers.
"""

from __future__ import annotations

import torch.nn as nn

from hf_ring.hf import guard as _guard
from hf_ring.hf.generation.entry import install_generation
from hf_ring.hf.multimodal.setup import guard_multimodal
from hf_ring.hf.support import RING_FLASH, check_model_supported
from hf_ring.patches.transformers import attn_implementation

__all__ = ["guard_if_requested", "guard_model", "guard_multimodal"]


def guard_model(model: nn.Module) -> None:
    """Guard ``model`` for ``ring_flash`` (idempotent): an image-text model as above, a text
    model with :func:`hf_ring.hf.guard.guard_model` and the hooks with which it generates under
    CP (:mod:`hf_ring.hf.generation.entry`)."""
    if not guard_multimodal(model):
        _guard.guard_model(model)
        install_generation(model)


def guard_if_requested(model: nn.Module) -> None:
    """Guard ``model`` if its config asks for ``ring_flash`` (the transformers patch hook)."""
    config = getattr(model, "config", None)
    if config is not None and attn_implementation(config) == RING_FLASH:
        check_model_supported(model)
        guard_model(model)
