"""Hugging Face layer: the ``ring_flash`` attention for transformers models, and the glue
(collator, loss, Accelerate / Trainer integration) around it."""
