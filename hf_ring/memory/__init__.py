"""Memory at long context: the chunked LM-head loss (no full logits tensor), activation
checkpoints offloaded to the host (and their copy engines), and the tiled MLP.

Must not import the Trainer, TRL, or hf_ring's training layer: the training layer turns
these on.
"""
