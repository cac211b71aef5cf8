"""The ring pattern: K/V blocks travel around the CP group while each rank computes; each
step's block schedule per layout (and per packed document, cut to a sliding window), the
forward and backward passes and their autograd Function.

Must not import transformers, accelerate, or hf_ring's integration or training layers.
"""
