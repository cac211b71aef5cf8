"""Process groups and transport: the dp x cp groups, point-to-point block streams and the
collectives the patterns use, each with its autograd where it carries gradients.

Owns nothing about attention: what travels is opaque tensors. Must not import
transformers, accelerate, or hf_ring's patterns, integration or training layers.
"""
