"""Training: the Accelerate plugin (dp x cp groups, batches fed per CP group), the
collators (text: shift on the full sequence, pad, shard; image-text: the full batch on
every rank, the labels sharded), the loss reduced by tokens over the dp x cp world, the
stock Trainer's eval loss under CP, ``RingTrainer``, the gradient reduction of sharded weights (DDP, FSDP2,
ZeRO) with the DeepSpeed glue, and the TRL trainers (``trl/``).

The top layer: it may import every other one, and no other layer imports it. Must not
import what would make a lower layer depend on it: a hook it installs is handed down as
an object (the plugin's state, the collator's batch), never looked up from below.
"""
