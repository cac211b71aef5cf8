"""Pipeline parallelism beside context parallelism: a Hugging Face causal LM cut into stages
and trained by PyTorch's own schedules (``torch.distributed.pipelining``).

``pp`` is the outermost axis of hf_ring's mesh (``pp, dp_replicate, dp_shard, cp, tp``): a
stage's ranks are a whole dp x cp x tp block with its own CP and TP groups, and the ring runs
inside a stage exactly as without PP. Modules, one job each: ``split`` (which layers each
stage holds), ``refusals`` (what is not composed yet, refused on every rank), ``stages`` (a
stage as a view of the model, run through the model's own forward), ``microbatches`` (a
step's batch as equal micro-batches, packed rows too), ``schedule`` (PyTorch's schedules, the
token-sum loss on the last stage, ``scale_grads=False``), ``grads`` (gradients summed over a
stage's dp x cp ranks, their norm and clipping over every stage), ``fsdp`` (FSDP2 inside a
stage: its weights sharded over its own dp x cp ranks, the plugin's ``pp_fsdp``).

Sits above the transformers integration and the memory layer and below the trainer, which
builds on it. Must not import accelerate, TRL, or hf_ring's training layer, except its loss
arithmetic (``hf_ring.training.loss``, torch only).
"""

from hf_ring.pipeline.grads import clip_pipeline_grad_norm_, pipeline_grad_norm, reduce_stage_gradients
from hf_ring.pipeline.schedule import SCHEDULES, PipelineRunner, TokenShareLoss, schedule_class, stages_per_rank_of
from hf_ring.pipeline.split import parse_pp_layers, stage_layer_ranges, stages_of_rank

__all__ = ["SCHEDULES", "PipelineRunner", "TokenShareLoss", "clip_pipeline_grad_norm_", "parse_pp_layers",
           "pipeline_grad_norm", "reduce_stage_gradients", "schedule_class", "stage_layer_ranges", "stages_of_rank",
           "stages_per_rank_of"]
