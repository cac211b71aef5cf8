"""``RingTrainer`` with pipeline parallelism: the Trainer's steps run through PyTorch's schedules.

Under ``RingAttentionPlugin(pp_size > 1)`` a ``RingTrainer`` cuts its model into this rank's
stages (``hf_ring.pipeline``) and runs every training step, and every evaluation batch
(forward only), through the plugin's schedule; the gradients are summed over each stage's
dp x cp ranks only and their norm (the logged ``grad_norm``, the clipping) taken over every
stage; ``save_model`` gathers the stages' layers into one whole model; checkpoints during
training hold that model, each stage's optimizer state and the layout, and
``train(resume_from_checkpoint=...)`` loads each rank's stages' part back. Modules, one job
each: ``checks`` (what is not composed with the stages, refused by name on every rank),
``checkpoint`` (checkpoints written and resumed by every stage),
``collator`` (a step's packed rows as the schedule's micro-batches), ``trainer`` (the
Trainer's training step, evaluation, gradient clipping and saving under PP).

Must not import TRL or ``hf_ring.training.trainer`` (which builds on this).
"""
