"""Context-parallel token mixers: causal convolutions with a halo and linear recurrences
(the gated delta rule, Mamba, KDA) whose pieces summarise themselves in small fixed-size
objects composed in global order; forward and backward exact.

This folder must not import transformers, accelerate, or hf_ring's hf, memory, training
or wrap layers: it is core, usable by anyone with their own model.
"""
