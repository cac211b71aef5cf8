"""The transformers integration: ``attn_implementation="ring_flash"`` (registration and the
attention function), the per-forward guard that validates a forward's inputs once and
hands the layers a :class:`~hf_ring.hf.forward_context.ForwardContext` holding their
plans, the masks, the exact local path without context parallelism, and model support
(``support/``: one detector per model feature that the ring must compute or refuse).

Must not import the Trainer, TRL, or hf_ring's training and memory layers.
"""
