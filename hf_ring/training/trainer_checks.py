"""What the Ring trainers refuse at construction, and why: each is a setting under which the
stock Trainer would compute something that context parallelism cannot reproduce exactly
(a mean over a shard, predictions split across ranks, a loss term from whole-batch
statistics), or one never checked against a run without CP (a quantised base model), so
it is an error that says what to change, never a silently different run.

Must not import TRL (the TRL trainers reuse these checks through ``RingTrainerBase``).
"""

from __future__ import annotations

from typing import Any, Optional

from hf_ring.hf.support import unrouted_token_mixers
from hf_ring.hf.support.router_balance import router_balance_of
from hf_ring.hf.support.tensor_parallel import model_tp_ranks
from hf_ring.training.pp.checks import check_pipeline_trainer
from hf_ring.patches import peft as peft_patches
from hf_ring.patches import transformers as transformers_patches
from hf_ring.patches.transformers.mixers import is_routed_layer, route_of
from hf_ring.training import weight_sharding
from hf_ring.training.collator import RingDataCollator
from hf_ring.training.vision.collator import RingVisionDataCollator

RING_ATTENTION = "ring_flash"


def _refuse_loss_terms(model: Any, tp_size: int) -> None:
    """Terms an MoE / Bamba model adds to its own loss when given labels, which the stock
    Trainer optimises. The router's load-balancing loss of Mixtral's form RingTrainer adds
    over the CP group's whole sequence (``hf_ring.hf.support.router_balance``, which refuses
    any other: JetMoE's ``aux_loss_coef``, a family whose function differs), not yet beside
    TP; Bamba's ``z_loss`` is refused. Refused rather than silently dropped."""
    balance = router_balance_of(model)
    if balance is not None and tp_size > 1:
        raise NotImplementedError(
            f"{balance.model}'s router load-balancing loss (output_router_logits=True) beside tensor parallelism "
            f"(tp_size={tp_size}) has not been checked against one process; set config.output_router_logits=False "
            "or train without TP")
    if getattr(model, "z_loss_coefficient", 0.0):
        raise NotImplementedError(
            f"{type(model).__name__} adds a z-loss (z_loss_coefficient={model.z_loss_coefficient}) to its own loss, "
            "which RingTrainer's token cross-entropy does not contain; set config.z_loss_coefficient=0.0"
        )


# bitsandbytes' quantised layers (and PEFT's LoRA layers over them), matched by class name so
# that bitsandbytes need not be installed to recognise them.
_QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt")


def quantization_markers(model: Any) -> Optional[str]:
    """What marks ``model`` (or the model under its PEFT adapters) as quantised, or None: the
    attributes transformers sets when it loads a model with a ``quantization_config``
    (``is_quantized``, ``quantization_method``, ``hf_quantizer``, ``is_loaded_in_4bit`` /
    ``is_loaded_in_8bit``, ``config.quantization_config``) and bitsandbytes' layers."""
    inner = peft_patches.base_model(model)
    config = getattr(inner, "config", None)
    found = []
    method = getattr(inner, "quantization_method", None)
    if method is not None:
        found.append(f"quantization_method={getattr(method, 'value', method)!r}")
    quant_config = getattr(config, "quantization_config", None)
    if quant_config is not None:
        quant_method = quant_config.get("quant_method") if isinstance(quant_config, dict) else getattr(
            quant_config, "quant_method", None)
        found.append(f"config.quantization_config (quant_method={getattr(quant_method, 'value', quant_method)!r})")
    flags = ("is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit")
    found += [name for name in flags if getattr(inner, name, False) is True]
    if getattr(inner, "hf_quantizer", None) is not None:
        found.append(f"hf_quantizer={type(inner.hf_quantizer).__name__}")
    layers = sorted({type(m).__name__ for m in inner.modules() if type(m).__name__ in _QUANTIZED_LAYERS})
    found += [f"{name} layers" for name in layers]
    return ", ".join(found) or None


def _refuse_quantized(model: Any, cp_size: int) -> None:
    """QLoRA (a bitsandbytes-quantised base model) under CP: bitsandbytes runs on CUDA only and
    hf_ring's exactness checks run on CPU, so it has never been checked against a run
    without CP; refused rather than trained unchecked."""
    markers = quantization_markers(model)
    if markers is not None:
        raise NotImplementedError(
            f"the model is quantised ({markers}): QLoRA and other quantised base models are not tested under "
            f"context parallelism (bitsandbytes runs on CUDA only; hf_ring's exactness checks run on CPU), so "
            f"RingTrainer refuses it at cp_size={cp_size}. Train the quantised model with cp_size=1, or load it "
            "unquantised (no quantization_config, e.g. dtype=torch.bfloat16) and train LoRA under CP"
        )


def refuse_placement(state: Any, trainer: str, rows: str) -> None:
    """Refuse ``placement="by_length"`` for a trainer that packs ``rows`` itself, each document
    cut over the CP group (the TRL preference and rollout trainers)."""
    if state.placement != "sharded":
        raise NotImplementedError(
            f"{trainer} packs {rows} itself, each document cut over the CP group; placement="
            f"{state.placement!r} is not composed with it yet: use placement='sharded' (RingTrainer and "
            "RingSFTTrainer place packed rows by length)"
        )


def check_reference_attention(ref_model: Any, cp_size: int, how: str) -> None:
    """Raise ValueError unless a TRL trainer's reference model (possibly wrapped) runs its
    attention through the ring; ``how`` says how to load it so."""
    inner = getattr(ref_model, "module", ref_model)
    impl = transformers_patches.attn_implementation(getattr(inner, "config", None))
    if impl != RING_ATTENTION:
        raise ValueError(
            f"cp_size={cp_size} but the reference model uses attn_implementation={impl!r}; {how} "
            f"attn_implementation={RING_ATTENTION!r}"
        )


def _check_token_averaging(args: Any, dp_size: int) -> None:
    """RingTrainer's loss is the stock Trainer's under ``average_tokens_across_devices=True``
    (the default); with False and several data-parallel ranks the stock one is another number."""
    if not getattr(args, "average_tokens_across_devices", True) and dp_size > 1:
        raise NotImplementedError(
            "average_tokens_across_devices=False with several data-parallel ranks: the stock Trainer then trains on "
            "the mean of each rank's own token mean, while RingTrainer computes the token mean over every dp x cp "
            "rank (and a model's router loss summed over the ranks); set average_tokens_across_devices=True "
            "(the default)")


def _check_distributed_config(model: Any) -> None:
    """What of transformers' ``DistributedConfig`` a Ring trainer cannot train with: pipeline
    parallelism (transformers' runs forward only: no backward communication between
    stages), refused by name rather than ignored. (``enable_sequence_parallel``, which
    transformers reserves and does not wire, is hf_ring's sequence parallelism inside TP.)"""
    config = getattr(getattr(peft_patches.base_model(model), "config", None), "distributed_config", None)
    if config is None:
        return
    if (getattr(config, "pp_size", 1) or 1) > 1:
        raise NotImplementedError(
            f"the model was loaded with DistributedConfig(pp_size={config.pp_size}): transformers' pipeline "
            "parallelism is inference-only (no backward between stages), so it cannot be trained; load it without "
            "pp_size (docs/parallelism.md says how pipeline stages would compose with CP)")


def _check_tensor_parallel(trainer: Any, subclass_loss: bool) -> None:
    """A tensor-parallel model (transformers' ``DistributedConfig``) needs the plugin's
    ``tp_size`` to be its own; only ``RingTrainer``'s loss has been checked beside TP."""
    _check_distributed_config(trainer.model)
    state = trainer.ring_state
    ranks = model_tp_ranks(peft_patches.base_model(trainer.model))
    model_tp = len(ranks) if ranks else 1
    if model_tp != state.tp_size:
        raise ValueError(
            f"the model is tensor-parallel over {model_tp} ranks but the context-parallel state has tp_size="
            f"{state.tp_size}: build the plugin as RingAttentionPlugin(cp_size={state.cp_size}, tp_size={model_tp}) "
            "(each CP group then holds ranks of one TP coordinate)"
        )
    if state.tp_size > 1 and subclass_loss:
        raise NotImplementedError(
            f"{type(trainer).__name__} beside tensor parallelism (tp_size={state.tp_size}) has not been checked "
            "against one process; RingTrainer has. Train the TP model with hf_ring.RingTrainer, or without TP"
        )
    if state.tp_size > 1 and getattr(trainer, "is_deepspeed_enabled", False):
        raise NotImplementedError("DeepSpeed beside transformers' tensor parallelism is not supported by hf_ring; "
                                  "load the model with DistributedConfig(tp_size=..., fsdp_size=...) instead")


def _check_compile_under_cp(trainer: Any, state: Any) -> None:
    """``TrainingArguments(torch_compile=True)`` under CP: each attention layer's ring runs as
    one custom op in the compiled graph (hf_ring/hf/compiled.py), checked against the eager
    run for every pattern (ring, all-gather, Ulysses, hybrid, auto) on dense and packed rows,
    packed rows placed by length, under DDP and FSDP2 compiled layer by layer, with the
    chunked loss, and for the routed token-mixer layers, one op each
    (tests/test_compile_cp.py, tests/test_compile_mixers.py, tests/test_trainer_cp.py); what
    has not been is refused by name."""
    args, model = trainer.args, trainer.model
    untested = []
    if state.tp_size > 1:
        untested.append(f"tensor parallelism (tp_size={state.tp_size})")
    if getattr(args, "gradient_checkpointing", False):
        # Checkpointed layers (transformers 5.25, non-reentrant) ran eagerly between compiled graphs: the ring's
        # op ran 0 times in the compiled forward (tests/test_compile_cp.py's setup, tried 2026-12-07).
        untested.append("gradient_checkpointing=True")
    if getattr(args, "ddp_find_unused_parameters", None) is not False:
        # DDP's search for unused parameters marked a gradient ready twice through the compiled graph.
        untested.append("ddp_find_unused_parameters left on (pass ddp_find_unused_parameters=False)")
    if getattr(trainer, "is_deepspeed_enabled", False):
        untested.append("DeepSpeed")
    dynamo = getattr(getattr(trainer.accelerator, "state", None), "dynamo_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) and not getattr(dynamo, "use_regional_compilation", False):
        # FSDP2's hooks split a whole compiled model at every unit; dynamo recompiled its frames past
        # its limit within 2 steps and ran them uncompiled. Per-layer compilation is checked.
        untested.append("FSDP2 with the whole model compiled (compile each decoder layer: "
                        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1, or dynamo_use_regional_compilation: true "
                        "in the Accelerate config; examples/finetune_llama_long.py --fsdp sets it)")
    carriers = {route_of(type(m)).carrier for m in model.modules() if is_routed_layer(m)} - {None}
    carried = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in carriers})
    if carried:
        untested.append(f"Mamba blocks run without keyword arguments ({', '.join(carried)}: their token mixers "
                        "cannot be handed their forward's context inside the compiled graph)")
    if isinstance(trainer.data_collator, RingVisionDataCollator):
        untested.append("image-text models")
    if untested:
        raise NotImplementedError(
            f"TrainingArguments(torch_compile=True) under context parallelism (cp_size={state.cp_size}) is "
            f"compiled and checked against the uncompiled run for every pattern on dense and packed rows, not "
            f"with {'; '.join(untested)}; set torch_compile=False, or drop what is named"
        )


def check_trainer_supported(trainer: Any, subclass_loss: bool) -> None:
    """Raise ValueError / NotImplementedError for what ``trainer`` (a Ring trainer whose
    Accelerator and ring state exist) cannot run exactly under context parallelism;
    ``subclass_loss``: a subclass (the TRL trainers) computes the loss its own way."""
    state, args = trainer.ring_state, trainer.args
    check_pipeline_trainer(trainer, subclass_loss)  # pp_size > 1: what is not composed with the stages
    if state.cp_size > 1:
        config = getattr(trainer.model, "config", None)
        impl = transformers_patches.attn_implementation(config) if config is not None else None
        if impl != RING_ATTENTION:
            raise ValueError(
                f"cp_size={state.cp_size} but the model uses attn_implementation={impl!r}; load it "
                f"with attn_implementation={RING_ATTENTION!r} (after `import hf_ring`), otherwise each "
                "rank would attend only within its own shard"
            )
        _refuse_quantized(trainer.model, state.cp_size)
        if getattr(args, "torch_compile", False):
            _check_compile_under_cp(trainer, state)
        if trainer.compute_metrics is not None:
            raise NotImplementedError(
                "compute_metrics is not tested under context parallelism; drop it (the eval loss is exact) and "
                "compute your metrics from trainer.predict(...), which returns whole rows gathered over the CP "
                "group, or evaluate with cp_size=1"
            )
    weight_sharding.check_accelerate_parallelism(trainer.accelerator)
    _check_tensor_parallel(trainer, subclass_loss)
    if trainer.compute_loss_func is not None:
        raise ValueError("RingTrainer computes the loss itself (token mean over dp x cp); drop compute_loss_func")
    if not subclass_loss:  # a subclass's own loss handles them (or refuses)
        _refuse_loss_terms(trainer.model, trainer.ring_state.tp_size)
    if not subclass_loss:
        _check_token_averaging(args, trainer.ring_state.dp_size)
    if args.label_smoothing_factor != 0:
        raise NotImplementedError("label smoothing is not supported by RingTrainer; set label_smoothing_factor=0")
    if getattr(args, "use_legacy_prediction_loop", False):
        raise NotImplementedError("RingTrainer needs the standard evaluation loop; set use_legacy_prediction_loop=False")
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise NotImplementedError(
            "train_sampling_strategy='batch_rebalance' shards batches over every process, not over "
            "data-parallel ranks; use 'random', 'sequential' or 'group_by_length'"
        )
    if args.n_gpu > 1:
        raise NotImplementedError(
            "torch.nn.DataParallel (several GPUs in one process) is not supported; launch one "
            "process per device with accelerate launch or torchrun"
        )
    collator = trainer.data_collator
    ring = collator if isinstance(collator, RingDataCollator) else getattr(collator, "ring", None)  # TRL's wraps one
    if isinstance(ring, (RingDataCollator, RingVisionDataCollator)) and ring.config.packing:
        # Stock transformers keeps packed documents apart in attention (from position_ids) but
        # not in convolutions and recurrences; hf_ring's ring_flash model does both.
        mixers = unrouted_token_mixers(trainer.model)
        if mixers:
            raise ValueError(
                f"packing=True: {mixers}. Build the model with attn_implementation={RING_ATTENTION!r} (after "
                "`import hf_ring`; at cp_size=1 too), whose mixers run each document on its own, or pack no rows"
            )
    if isinstance(collator, (RingDataCollator, RingVisionDataCollator)):
        cfg = collator.config
        if not collator.matches(state):
            placement = getattr(cfg, "placement", "sharded")
            if isinstance(collator, RingVisionDataCollator) and state.placement != "sharded":
                raise NotImplementedError(
                    f"placement={state.placement!r} places the documents of packed text rows; image-text batches "
                    "(RingVisionDataCollator) are not placed by length yet: use placement='sharded'"
                )
            raise ValueError(
                f"the data collator shards for cp_size={cfg.cp_size}, cp_rank={cfg.cp_rank}, "
                f"layout={cfg.layout!r}, placement={placement!r} but this process is cp_rank {state.cp_rank} of "
                f"{state.cp_size} with layout={state.layout!r}, placement={state.placement!r}; build it with "
                "ring_plugin.make_collator(...)"
            )
