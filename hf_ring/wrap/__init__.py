"""``ContextParallel.wrap``: context parallelism for a user's own attention module (one
that calls ``scaled_dot_product_attention``), routed to the public context-parallel op.

Sits beside the Hugging Face integration, on the core alone: must not import
transformers, accelerate, or hf_ring's hf, memory or training layers.
"""
