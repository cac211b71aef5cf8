"""Which models ``ring_flash`` can run exactly, read from the model itself.

Why: the ring computes attention across ranks, and only attention. Everything else a
model does along the sequence runs on the tokens a rank holds: under context parallelism
(CP) its shard, in packed rows the whole row across document boundaries. The guard
checks that every attention layer ran the ring, but a model can be wrong without any
attention layer being skipped (issue 10): a short convolution or a Mamba mixer sees only
the local shard, a RoPE whose frequencies depend on the sequence length picks them from
the shard's largest position, a sliding window that the model applies through its mask
only never reaches the attention function, Llama 4's temperature tuning numbers the
local tokens from 0. Each of these trains a different function from the model without
CP, and says nothing. So the model is read (its modules and its config, once per model
and config) and refused, naming the module or the config field and what to do, where it
cannot be run exactly.

One module per kind of model feature, each a detector: ``token_mixers`` (convolutions,
SSM / linear-recurrence mixers), ``layer_kinds`` (the config's layer kinds),
``interface`` (attention that bypasses transformers' attention interface),
``position_bias`` (ALiBi biases a model adds to its mask),
``rope`` (length-dependent RoPE),
``windows`` (sliding windows and chunks), ``temperature`` (Llama 4's temperature tuning),
``tensor_parallel`` (a TP model's group must be the CP state's, or the ring mixes heads);
``reading`` holds what they share, ``detectors`` their list and the two entry points,
:func:`check_model_under_cp` and :func:`check_model_supported`, and what the ring is handed from
the reading (:func:`handed_to_the_ring`).

Part of the transformers integration: must not import Trainer, TRL, or hf_ring's training
or memory layers.
"""

from hf_ring.hf.support.detectors import (
    check_model_supported,
    check_model_under_cp,
    handed_to_the_ring,
    unrouted_token_mixers,
)
from hf_ring.hf.support.reading import RING_FLASH

__all__ = ["RING_FLASH", "check_model_supported", "check_model_under_cp", "handed_to_the_ring", "unrouted_token_mixers"]
