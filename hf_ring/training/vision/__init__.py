"""Image-text batches for training under context parallelism: :mod:`.collator`
(``RingVisionDataCollator``: the full batch on every rank, only the labels sharded) and
:mod:`.packing` (image-text samples packed into one row, each with its own images and
positions).

Part of the training layer, below the trainers: must not import ``hf_ring.training.trainer``
or TRL (the trainers and the plugin import this package, not the other way round).
"""
