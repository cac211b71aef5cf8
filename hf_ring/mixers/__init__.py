"""Context-parallel token mixers: the layers of hybrid models that mix tokens along the
sequence without attention, computed exactly when the sequence is split across the ranks
of a context-parallel group.

- :func:`~hf_ring.mixers.conv.context_parallel_causal_conv1d`: the short causal depthwise
  convolution of Mamba-2, gated delta nets, LFM2 and the other hybrids; every run of
  tokens a rank holds gets the ``width - 1`` inputs before it (its halo) from the ranks
  that hold them, and the halo's gradient goes back to them.
- :func:`~hf_ring.mixers.delta_rule.context_parallel_gated_delta_rule`: the gated delta
  rule (Qwen3-Next, Qwen3.5, OLMo hybrid); each run summarises itself in its transition
  and its state from zero, one all-gather composes them in sequence order, and each run
  reruns from its true incoming state (``state_exchange`` composes, ``delta_rule_chunk``
  is the chunked scan).
- :func:`~hf_ring.mixers.ssd.context_parallel_ssd`: Mamba-2's SSD chunk scan (Granite 4
  hybrid, Nemotron-H, Falcon-H1, Bamba, Zamba2, Mamba-2): one decay per head, so each
  piece's summary is its state from zero and one scalar transition per head.
- :func:`~hf_ring.mixers.selective_scan.context_parallel_selective_scan`: Mamba-1's
  selective scan (Mamba, Falcon-Mamba, Jamba, Zamba): a diagonal transition per channel
  and state entry.
- :func:`~hf_ring.mixers.kimi_delta.context_parallel_kimi_delta_attention`: Kimi delta
  attention (Kimi Linear and its kin): the delta rule with a decay per key channel.

Each rank's runs of consecutive tokens and their place in sequence order come from
:mod:`hf_ring.sharding.pieces`; what travels goes through :mod:`hf_ring.distributed`'s
collectives. Usable without transformers: a user with their own model calls the ops
directly.

This layer must not import transformers, accelerate, or hf_ring's patterns, hf, memory,
training or wrap layers.
"""

from hf_ring.mixers.conv import CONV_ACTIVATIONS, causal_conv1d_pieces, context_parallel_causal_conv1d
from hf_ring.mixers.delta_rule import context_parallel_gated_delta_rule
from hf_ring.mixers.kimi_delta import context_parallel_kimi_delta_attention
from hf_ring.mixers.selective_scan import context_parallel_selective_scan
from hf_ring.mixers.ssd import context_parallel_ssd

__all__ = ["CONV_ACTIVATIONS", "causal_conv1d_pieces", "context_parallel_causal_conv1d",
           "context_parallel_gated_delta_rule", "context_parallel_kimi_delta_attention",
           "context_parallel_selective_scan", "context_parallel_ssd"]
