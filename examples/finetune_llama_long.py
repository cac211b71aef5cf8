"""Fine-tune a Llama model at long context with the HF Trainer and context parallelism.

One process per device; the sequence of every batch is split over ``--cp_size`` processes
(ring attention), the batches over the remaining data-parallel ranks.

    # CPU, 2 processes, one CP group of 2 (--multi_gpu makes accelerate start the processes
    # with torchrun; without it, on a machine with no GPU, it starts only one):
    accelerate launch --multi_gpu --num_processes 2 examples/finetune_llama_long.py --cp_size 2
    # or with the config beside this file:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/finetune_llama_long.py --cp_size 2
    # the same with the weights sharded by DeepSpeed ZeRO-3 (examples/ds_zero2.json: ZeRO-2):
    torchrun --nproc_per_node 2 examples/finetune_llama_long.py --cp_size 2 --deepspeed examples/ds_zero3.json
    # 8 GPUs, 2 data-parallel x 4 context-parallel, a real checkpoint:
    accelerate launch --config_file examples/accelerate_gpu.yaml examples/finetune_llama_long.py \\
        --cp_size 4 --seq_len 65536 --model_name_or_path /path/to/llama --bf16
    # weights sharded with FSDP2 over every process (or --fsdp hybrid_shard: HSDP), CPU or GPU:
    accelerate launch --config_file examples/accelerate_fsdp_cpu.yaml examples/finetune_llama_long.py --cp_size 2
    torchrun --nproc_per_node 4 examples/finetune_llama_long.py --cp_size 2 --fsdp full_shard
    # pipeline parallelism beside CP, 4 processes: pp 2 (PyTorch's 1F1B, 2 micro-batches a step) x cp 2:
    accelerate launch --multi_gpu --num_processes 4 examples/finetune_llama_long.py --pp_size 2 --cp_size 2 \
        --pp_schedule 1F1B --pp_microbatches 2 --per_device_train_batch_size 2  # --fsdp full_shard: FSDP2 in each stage
    # tensor parallelism beside CP, 4 processes: tp 2 x cp 2 (the model loaded with transformers'
    # DistributedConfig(tp_size=2, fsdp_size=2): FSDP2 over the CP ranks, TP innermost):
    accelerate launch --multi_gpu --num_processes 4 examples/finetune_llama_long.py --tp_size 2 --cp_size 2
    # the sizes written the Accelerate way (accelerate asks for FSDP2 with a parallelism config);
    # hf_ring runs the CP, torch's is not engaged:
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 --use_parallelism_config \
        --parallelism_config_cp_size 2 examples/finetune_llama_long.py

Longest context per device (README, "Longest context per device"): the loss is computed
chunk by chunk without the full logits by default under CP (``--chunked_loss``);
``--offload_checkpoints`` keeps every layer's checkpointed input in host memory and
``--tiled_mlp TOKENS`` computes the MLPs in tiles; ``--vocab_size 128256`` gives the default
model a Llama-3-sized vocabulary.

Default: a tiny Llama initialised on the spot, a byte-level tokenizer and a synthetic
passkey-retrieval set (loss on the answer only), so nothing is downloaded.

At the end the final model is saved in ``--output_dir`` (default ``output/finetune_llama_long``;
``--no_save_model``: not), with its config, so that it reloads with ``from_pretrained``:

    accelerate launch --config_file examples/accelerate_cpu.yaml examples/generate_long.py --cp_size 2 \\
        --model_name_or_path output/finetune_llama_long
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
from typing import Optional, Sequence

import torch
import transformers
from accelerate import PartialState
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, TrainingArguments

import hf_ring
from hf_ring.hf.support.router_balance import router_balance_of
from hf_ring.training import deepspeed_support
from hf_ring.training.weight_sharding import FSDP_MODES, fsdp_training_arguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context_data import ByteTokenizer, passkey_dataset  # noqa: E402
from passkey_eval import PasskeyGenerationEval  # noqa: E402
from text_documents import file_sets, tokenized_documents  # noqa: E402


def build_parser(description: Optional[str] = __doc__) -> argparse.ArgumentParser:
    """The example's flags (the TRL examples add theirs to the same parser)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp_size", type=int, default=None,
                   help="processes per context-parallel group (default: accelerate launch's "
                        "--parallelism_config_cp_size, else 1)")
    p.add_argument("--tp_size", type=int, default=None,
                   help="tensor-parallel ranks (transformers' DistributedConfig; FSDP2 over the other ranks)")
    p.add_argument("--sequence_parallel", action="store_true",
                   help="with --tp_size > 1: each TP rank keeps 1/tp_size of its tokens between the attention and "
                        "MLP blocks (DistributedConfig(enable_sequence_parallel=True), run by hf_ring)")
    p.add_argument("--pp_size", type=int, default=1,
                   help="pipeline stages (the outermost axis): the model's decoder layers cut into stages, trained "
                        "by PyTorch's schedule (--pp_schedule) over --pp_microbatches micro-batches a step")
    p.add_argument("--pp_schedule", default="1F1B",
                   choices=["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"],
                   help="--pp_size > 1: PyTorch's schedule (the interleaved and zero-bubble ones hold two stages a "
                        "rank: give --num_layers at least 2 x pp_size)")
    p.add_argument("--pp_microbatches", type=int, default=None,
                   help="--pp_size > 1: micro-batches a step (default: pp_size; the 1F1B family needs at least as "
                        "many as stages); each takes per_device_train_batch_size / pp_microbatches examples")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "stripe", "contiguous"],
                   help="how each sequence is split over a CP group (packing needs zigzag)")
    p.add_argument("--cp_pattern", default="ring", choices=["ring", "allgather", "ulysses", "hybrid", "auto"],
                   help="how attention is split across a CP group ('auto': picked per model, logged)")
    p.add_argument("--ulysses_size", type=int, default=None, help="--cp_pattern hybrid: ranks per Ulysses group")
    p.add_argument("--attn_backend", default="auto",
                   help="the attention kernel: 'auto' (per layer, the first that computes its features on "
                        "this device) or a name from hf_ring.kernels.available_backends(device, dtype)")
    p.add_argument("--seq_len", type=int, default=8192, help="longest example, in tokens")
    p.add_argument("--packing", action="store_true", help="pack each batch's examples into one row")
    p.add_argument("--cp_placement", default="sharded", choices=["sharded", "by_length", "auto"],
                   help="--packing: cut every document over the CP group (sharded), keep short documents whole "
                        "on one rank and shard only the long ones, balanced (by_length), or per batch whichever "
                        "of the two the cost model makes cheaper (auto; docs/packed.md)")
    p.add_argument("--max_tokens_per_rank", type=int, default=None,
                   help="--cp_placement by_length or auto: the most tokens one rank may hold")
    p.add_argument("--max_steps", type=int, default=60)
    p.add_argument("--output_dir", default="output/finetune_llama_long")
    p.add_argument("--model_name_or_path", default=None, help="a real checkpoint instead of the tiny default model")
    p.add_argument("--tokenizer_name", default=None,
                   help="with --model_name_or_path: the tokenizer (name or folder) when the checkpoint has none "
                        "beside it; default: the checkpoint's own")
    p.add_argument("--config_name", default=None,
                   help="a model config (file or folder) to build from scratch instead of the tiny Llama; "
                        "its vocabulary is set to the byte tokenizer's")
    p.add_argument("--attn_implementation", default=None,
                   help="default: ring_flash when cp_size > 1, else sdpa")
    p.add_argument("--hidden_size", type=int, default=128, help="default model only")
    p.add_argument("--num_layers", type=int, default=2, help="default model only")
    p.add_argument("--moe_experts", type=int, default=0,
                   help="default model only: N > 0 makes it a Qwen3-MoE with N experts (2 per token) and its "
                        "router load-balancing loss")
    p.add_argument("--router_aux_loss_coef", type=float, default=0.01,
                   help="--moe_experts: the weight of the router's load-balancing loss (0: none)")
    p.add_argument("--ep_size", type=int, default=1,
                   help="expert-parallel ranks (transformers' DistributedConfig(ep_size=...)): each holds "
                        "1/ep_size of every MoE layer's experts; FSDP2 over the dp x cp ranks")
    p.add_argument("--tie_word_embeddings", action="store_true",
                   help="default model only: the LM head shares the input embeddings' weight")
    p.add_argument("--vocab_size", type=int, default=None,
                   help="default model only: its vocabulary size (default: the byte tokenizer's 259; "
                        "the tokenizer's ids stay below it), e.g. 128256 to measure a Llama-3 vocabulary")
    p.add_argument("--chunked_loss", default="auto", choices=["auto", "on", "off"],
                   help="LM head + loss by chunks of tokens, never the full logits (auto: on when cp_size > 1)")
    p.add_argument("--loss_chunk_tokens", type=int, default=None,
                   help="tokens per chunk of the chunked loss (default: 64 MiB of float32 logits)")
    p.add_argument("--offload_checkpoints", action="store_true",
                   help="checkpoint every decoder layer, its saved input kept in host memory")
    p.add_argument("--tiled_mlp", type=int, default=0, metavar="TOKENS",
                   help="compute every MLP in tiles of this many tokens (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per_device_train_batch_size", type=int, default=1,
                   help="examples per data-parallel rank and micro-step (with --packing: documents per row)")
    p.add_argument("--per_device_eval_batch_size", type=int, default=1)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--num_train_examples", type=int, default=256)
    p.add_argument("--num_eval_examples", type=int, default=8)
    p.add_argument("--eval_steps", type=int, default=30, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--generate_eval", type=int, default=0, metavar="N",
                   help="at every evaluation, answer N eval prompts by generation (under CP: prefilled by the ring) "
                        "and log eval_passkey_accuracy and eval_passkey_token_accuracy")
    p.add_argument("--save_steps", type=int, default=0,
                   help="checkpoint every N steps (0: no checkpoints; the final model is saved either way)")
    p.add_argument("--no_save_model", action="store_true",
                   help="do not save the final model in --output_dir at the end (by default it is saved with its "
                        "config, and the checkpoint's tokenizer when --model_name_or_path gave one, so that "
                        "from_pretrained and examples/generate_long.py --model_name_or_path OUTPUT_DIR reload it)")
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--bf16", action="store_true",
                   help="weights and compute in bfloat16 (no float32 master copy, no autocast)")
    p.add_argument("--disable_tqdm", action="store_true")
    p.add_argument("--torch_compile", action="store_true",
                   help="compile the model (TrainingArguments(torch_compile=True), inductor); under CP each "
                        "attention layer's ring is one custom op in the compiled graph (docs/performance.md)")
    p.add_argument("--torch_compile_backend", default="inductor",
                   help="--torch_compile: the torch.compile backend (aot_eager: the same graphs without code generation)")
    p.add_argument("--fsdp", default=None, choices=list(FSDP_MODES),
                   help="shard the weights with FSDP2: full_shard over every dp x cp process, or "
                        "hybrid_shard (HSDP: shard over the CP group, replicate over dp); with --pp_size > 1, "
                        "full_shard shards each stage over its own dp x cp processes (the plugin's pp_fsdp)")
    p.add_argument("--deepspeed", default=None,
                   help="a DeepSpeed config (JSON), e.g. examples/ds_zero3.json: ZeRO shards the weights")
    p.add_argument("--lora_r", type=int, default=0,
                   help="train a LoRA adapter of this rank (PEFT) instead of every weight (0: off); it is saved "
                        "in --output_dir at the end (unless --no_save_model) and loads into the plain model with "
                        "PeftModel.from_pretrained")
    p.add_argument("--lora_modules", default="q_proj,v_proj", help="--lora_r: the modules it adapts")
    p.add_argument("--lora_init_seed", type=int, default=None,
                   help="--lora_r: draw each adapter's A from a generator seeded by this and the weight's name, the "
                        "whole matrix on every rank (each keeps its part; B stays 0), so that the adapter starts the "
                        "same at any tp / cp size. PEFT 0.21's own draw depends on how the model was loaded and, "
                        "beside tensor parallelism, on each rank's part of the layer")
    p.add_argument("--pad_to_multiple_of", type=int, default=None,
                   help="pad rows (or packed documents) to a multiple of this (default: what the layout needs, "
                        "2 x cp_size for zigzag); with dropout, runs at other cp sizes compare step for step only "
                        "when padded alike: one process's mask of a row depends on the batch's padded length")
    p.add_argument("--lora_dropout", type=float, default=0.0,
                   help="--lora_r: dropout on the adapters' inputs; under CP each token gets the mask one "
                        "process gives it from the same seed (docs/randomness.md)")
    p.add_argument("--stock_trainer", action="store_true",
                   help="--cp_size 1 only: the stock transformers Trainer and the model's own loss, what hf_ring's "
                        "runs are compared against")
    return p


def add_own_data_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--train_file``, ``--eval_file``, ``--eval_share``: train on your own documents
    (examples/text_documents.py); the examples that read them add these to their parser."""
    p.add_argument("--train_file", default=None,
                   help="your own documents instead of the synthetic set: JSON lines (.jsonl/.json), parquet or "
                        "text (.txt, one document per paragraph), read through datasets, a 'text' column. Each "
                        "document is one example, tokenized whole by the example's tokenizer and never cut into "
                        "blocks; one longer than --seq_len tokens is truncated to its first --seq_len (the count "
                        "is printed). --num_train_examples / --num_eval_examples apply to the synthetic set only")
    p.add_argument("--eval_file", default=None, help="with --train_file: documents to evaluate on (eval_loss)")
    p.add_argument("--eval_share", type=float, default=0.0,
                   help="with --train_file and no --eval_file: hold out this share of its documents (at least "
                        "one, drawn with --seed) to evaluate on, e.g. 0.05 (0: no evaluation)")
    return p


def evaluates(args: argparse.Namespace) -> bool:
    """Whether the run has an evaluation set: the held-out or --eval_file documents with
    --train_file, else --num_eval_examples synthetic ones."""
    if getattr(args, "train_file", None):
        return bool(args.eval_file) or args.eval_share > 0
    return args.num_eval_examples > 0


def parse_args(
    argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
) -> argparse.Namespace:
    """The flags of ``parser`` (default: :func:`build_parser` with :func:`add_own_data_flags`),
    checked together."""
    parser = parser if parser is not None else add_own_data_flags(build_parser())
    args = parser.parse_args(argv)
    _sizes_from_launch(parser, args)
    if getattr(args, "train_file", None) is None and (getattr(args, "eval_file", None)
                                                      or getattr(args, "eval_share", 0.0)):
        parser.error("--eval_file / --eval_share evaluate on your own documents: they go with --train_file")
    if getattr(args, "eval_file", None) and args.eval_share:
        parser.error("--eval_file and --eval_share both say what to evaluate on: give one")
    if getattr(args, "train_file", None) and args.generate_eval:
        parser.error("--generate_eval answers the synthetic passkey prompts: not with --train_file")
    if args.fsdp and args.deepspeed:
        parser.error("--fsdp and --deepspeed both shard the weights: choose one")
    if args.stock_trainer and (args.cp_size != 1 or args.packing or args.tp_size != 1 or args.ep_size != 1):
        parser.error("--stock_trainer runs plain transformers: --cp_size 1, --tp_size 1, --ep_size 1, no --packing")
    for flag in ("tp_size", "ep_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.moe_experts < 0 or (args.moe_experts and args.moe_experts < 2):
        parser.error(f"--moe_experts must be 0 (a dense model) or >= 2, got {args.moe_experts}")
    if not 0 <= args.generate_eval <= args.num_eval_examples:
        parser.error(f"--generate_eval {args.generate_eval} answers that many of the --num_eval_examples "
                     f"{args.num_eval_examples} eval prompts: 0 to {args.num_eval_examples}")
    _check_pipeline_flags(parser, args)
    if args.sequence_parallel and args.tp_size < 2:
        parser.error("--sequence_parallel splits each TP group's tokens: it needs --tp_size 2 or more")
    if args.ep_size > 1 and args.tp_size > 1:
        parser.error("--ep_size with --tp_size: expert parallelism beside tensor parallelism has not been checked "
                     "against one process (docs/parallelism.md); use one of them")
    if args.ep_size > 1 and not (args.moe_experts or args.model_name_or_path or args.config_name):
        parser.error("--ep_size needs a mixture-of-experts model: --moe_experts N (or an MoE checkpoint)")
    if args.tp_size > 1 or args.ep_size > 1:
        beside = [flag for flag, given in (("--fsdp", args.fsdp), ("--deepspeed", args.deepspeed),
                                           ("--lora_r", args.lora_r and args.ep_size > 1),
                                           ("--offload_checkpoints", args.offload_checkpoints),
                                           ("--tiled_mlp", args.tiled_mlp))
                  if given]
        if beside:
            parser.error(f"--tp_size {args.tp_size} --ep_size {args.ep_size} with {', '.join(beside)}: not checked "
                         "beside tensor or expert parallelism (the weights are sharded by transformers' "
                         "DistributedConfig: FSDP2 over the dp x cp ranks)")
    return args


def _check_pipeline_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--pp_size / --pp_microbatches checked, and what is not composed with pipeline stages yet
    refused (hf_ring.training.pp.checks says why for each)."""
    if args.pp_size < 1:
        parser.error(f"--pp_size must be >= 1, got {args.pp_size}")
    if args.pp_microbatches is None:
        args.pp_microbatches = args.pp_size
    if args.pp_size == 1:
        return
    if args.pp_microbatches < 1 or args.per_device_train_batch_size % args.pp_microbatches:
        parser.error(f"--pp_microbatches {args.pp_microbatches} must divide --per_device_train_batch_size "
                     f"{args.per_device_train_batch_size} (each micro-batch the same number of examples)")
    given = [flag for flag, value in (
        ("--tp_size", args.tp_size > 1), ("--ep_size", args.ep_size > 1),
        ("--fsdp hybrid_shard", args.fsdp == "hybrid_shard"),  # full_shard: each stage over its own dp x cp ranks
        (f"--fsdp full_shard under --pp_schedule {args.pp_schedule}",
         args.fsdp == "full_shard" and args.pp_schedule in ("InterleavedZeroBubble", "ZBVZeroBubble")),
        ("--deepspeed", args.deepspeed), ("--lora_r", args.lora_r), ("--offload_checkpoints", args.offload_checkpoints),
        ("--tiled_mlp", args.tiled_mlp), ("--torch_compile", args.torch_compile),  # --save_steps, resuming: composed
        ("--generate_eval", args.generate_eval),
        ("--moe_experts", args.moe_experts), ("--tie_word_embeddings", args.tie_word_embeddings),
        ("--stock_trainer", args.stock_trainer),
        ("--cp_pattern " + args.cp_pattern, args.cp_pattern != "ring"),
        ("--cp_placement " + args.cp_placement, args.cp_placement != "sharded")) if value]
    if given:
        parser.error(f"--pp_size {args.pp_size} with {', '.join(given)}: not composed with pipeline stages yet "
                     "(docs/parallelism.md, 'Pipeline parallelism x context parallelism'); drop them or use --pp_size 1")


def _sizes_from_launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--cp_size`` and ``--tp_size`` from accelerate launch's parallelism config
    (``--use_parallelism_config --parallelism_config_cp_size C``) where it gives one, else 1;
    flags that contradict it are refused."""
    from hf_ring.training.parallelism_config import plugin_sizes, requested_parallelism_config

    config = requested_parallelism_config(None)
    launched = plugin_sizes(config) if config is not None else (1, 1)
    for i, flag in enumerate(("cp_size", "tp_size")):
        given = getattr(args, flag)
        if config is not None and given is not None and given != launched[i]:
            parser.error(f"--{flag} {given} but the launch's parallelism config says {flag}={launched[i]}: give it once")
        setattr(args, flag, launched[i] if given is None else given)


def refuse_memory_options(parser: argparse.ArgumentParser, args: argparse.Namespace, why: str) -> None:
    """Stop with an error when a script that cannot apply them is given this example's
    long-context memory options (rather than ignoring them)."""
    given = [flag for flag, value, default in (
        ("--chunked_loss", args.chunked_loss, "auto"), ("--loss_chunk_tokens", args.loss_chunk_tokens, None),
        ("--offload_checkpoints", args.offload_checkpoints, False), ("--tiled_mlp", args.tiled_mlp, 0),
    ) if value != default]
    if given:
        parser.error(f"{', '.join(given)}: not applied here ({why})")


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    evaluate = evaluates(args) and args.eval_steps > 0
    if args.torch_compile and args.fsdp:
        # FSDP2 splits a whole compiled model at every unit's hooks: compile each decoder layer (Accelerate's
        # regional compilation, torchtitan's recipe), as hf_ring requires under CP (docs/performance.md). Set,
        # not defaulted: accelerate launch always passes its own (False unless configured).
        os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "1"
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=args.logging_steps,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=args.eval_steps if evaluate else None,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        seed=args.seed,
        data_seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        ddp_find_unused_parameters=False,  # every parameter is used: spare DDP the graph walk
        disable_tqdm=args.disable_tqdm,
        torch_compile=args.torch_compile,
        torch_compile_backend=args.torch_compile_backend if args.torch_compile else None,
        **fsdp_training_arguments(args.fsdp if args.pp_size == 1 else None, args.cp_size),  # PP: the plugin's pp_fsdp
        deepspeed=args.deepspeed,
    )


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def build_model(args: argparse.Namespace, tokenizer, attn_implementation: str,
                training_args: Optional[TrainingArguments] = None) -> torch.nn.Module:
    """The model to train; ``training_args`` tell whether ZeRO-3 is configured (None: it is not).
    With ``--tp_size`` or ``--ep_size`` > 1 it is loaded sharded (:func:`_load_distributed`)."""
    if args.model_name_or_path:
        if args.vocab_size is not None:
            raise ValueError("--vocab_size applies to the default model only, not to --model_name_or_path")
        if args.tp_size > 1 or args.ep_size > 1:
            return _load_distributed(args.model_name_or_path, args, attn_implementation)
        return AutoModelForCausalLM.from_pretrained(
            args.model_name_or_path, attn_implementation=attn_implementation, dtype=_dtype(args)
        )
    if args.config_name:
        config = AutoConfig.from_pretrained(args.config_name)
        config.vocab_size = len(tokenizer)
        config.pad_token_id, config.bos_token_id, config.eos_token_id = (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
        config.use_cache = False
    else:
        config = _default_config(args, tokenizer)
    # Whole even under ZeRO-3 (partitioned when the Trainer wraps it): the same --seed, the same weights.
    with deepspeed_support.constructed_whole(training_args):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(_dtype(args))
    if args.tp_size == 1 and args.ep_size == 1:
        return model
    # transformers shards a model for TP and EP as it loads it: the initial weights go through a checkpoint,
    # which the main process writes (save_pretrained writes on rank 0 only) and every process reads.
    initial, state = os.path.join(args.output_dir, "tp_initial_weights"), PartialState()
    if state.is_main_process:
        model.save_pretrained(initial)
    state.wait_for_everyone()
    model = _load_distributed(initial, args, attn_implementation)
    state.wait_for_everyone()
    if state.is_main_process:
        shutil.rmtree(initial)
    return model


def _load_distributed(path: str, args: argparse.Namespace, attn_implementation: str) -> torch.nn.Module:
    """The checkpoint at ``path`` loaded with transformers' ``DistributedConfig``: TP over
    ``--tp_size`` ranks (innermost), FSDP2 over the others (the dp x cp ranks), and each MoE
    layer's experts split over ``--ep_size`` ranks."""
    from hf_ring.patches.transformers import distributed_config_takes_sizes

    if not distributed_config_takes_sizes():
        raise SystemExit(f"--tp_size / --ep_size need transformers' DistributedConfig(tp_size=..., fsdp_size=...) "
                         f"(transformers 5.x); transformers {transformers.__version__} has none")
    from transformers.distributed import DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = dict(ep_size=args.ep_size) if args.ep_size > 1 else {}
    if args.sequence_parallel:
        sizes["enable_sequence_parallel"] = True
    # A LoRA's frozen base weights replicated over the dp x cp ranks: PEFT 0.21 sizes adapters from an FSDP2
    # shard (PEFT 0.22 runs either load).
    sizes["dp_replicate_size" if args.lora_r else "fsdp_size"] = world // args.tp_size
    config = DistributedConfig(tp_size=args.tp_size, **sizes)
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=config,
                                                attn_implementation=attn_implementation, dtype=_dtype(args))


def _default_config(args: argparse.Namespace, tokenizer) -> transformers.PretrainedConfig:
    """The embedded default: a small Llama sized by --hidden_size and --num_layers, or with
    --moe_experts a Qwen3-MoE of the same sizes (every layer's MLP a mixture of experts)."""
    heads = max(2, args.hidden_size // 16)
    vocab_size = args.vocab_size if args.vocab_size is not None else len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"--vocab_size {vocab_size} is below the tokenizer's {len(tokenizer)} ids")
    if args.moe_experts:
        return transformers.Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
            moe_intermediate_size=args.hidden_size, num_experts=args.moe_experts, num_experts_per_tok=2,
            num_hidden_layers=args.num_layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
            head_dim=args.hidden_size // heads, max_position_embeddings=2 * args.seq_len,
            output_router_logits=args.router_aux_loss_coef > 0, router_aux_loss_coef=args.router_aux_loss_coef,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, use_cache=False, tie_word_embeddings=args.tie_word_embeddings)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=2 * args.seq_len,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=False,
        tie_word_embeddings=args.tie_word_embeddings,
    )


def share_cores() -> None:
    """On CPU, give each launched process its share of the cores, unless the user chose a count.

    torchrun and ``accelerate launch`` start several processes with ``OMP_NUM_THREADS=1`` when
    the user set nothing, so only that launcher default (several local processes, one thread
    each), or no ``OMP_NUM_THREADS`` at all beside several local processes (torch would give
    each the whole machine), is replaced by ``cores // processes``. A count the user chose
    stands: any other ``OMP_NUM_THREADS``, ``torch.set_num_threads`` called before under a
    launcher, and every single-process run, where torch's own default (or the user's) already
    holds (overriding it made a cp 1 run on a loaded machine 10x slower and cp 2 look faster
    than it is).
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() or local == 1:
        return
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp is not None and (omp != "1" or torch.get_num_threads() != 1):
        return  # the user's count (a launcher's default is exactly OMP_NUM_THREADS=1, as torch read it)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def start_plugin(args: argparse.Namespace) -> hf_ring.RingAttentionPlugin:
    """The plugin with its dp x cp groups built (after the process group is up); prints this rank's place."""
    logging.getLogger("hf_ring").setLevel(logging.INFO)  # --cp_pattern auto says what it picked
    logging.getLogger("hf_ring").addHandler(logging.StreamHandler(sys.stdout))
    plugin = hf_ring.RingAttentionPlugin(cp_size=args.cp_size, tp_size=args.tp_size, layout=args.layout,
                                         pattern=args.cp_pattern, ulysses_size=args.ulysses_size,
                                         backend=args.attn_backend, placement=args.cp_placement,
                                         max_tokens_per_rank=args.max_tokens_per_rank, pp_size=args.pp_size,
                                         pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
                                         pp_fsdp=args.pp_size > 1 and args.fsdp == "full_shard")
    state = plugin.setup()
    grid = f"dp_size {state.dp_size} x cp_size {state.cp_size}" + (f" x tp_size {state.tp_size}" if state.tp_size > 1
                                                                     else "")
    if args.ep_size > 1:
        grid += f"; experts over ep_size {args.ep_size}"
    if args.pp_size > 1:
        grid = f"pp_size {args.pp_size} ({args.pp_schedule}, {args.pp_microbatches} micro-batches) x " + grid + (
            ", FSDP2 inside each stage" if plugin.pp_fsdp else "")
    print(f"[hf_ring] {plugin.describe()} ({grid})", flush=True)
    return plugin


def tokenizer_source(args: argparse.Namespace) -> str:
    """Where the checkpoint's tokenizer is read from: ``--tokenizer_name``, else the checkpoint."""
    if args.tokenizer_name and not args.model_name_or_path:
        raise ValueError("--tokenizer_name goes with --model_name_or_path (the default model has its own tokenizer)")
    return args.tokenizer_name or args.model_name_or_path


def main(argv: Optional[Sequence[str]] = None, callbacks: Optional[list] = None) -> dict:
    """Train and evaluate; ``callbacks`` (TrainerCallback) join the Trainer's."""
    args = parse_args(argv)
    share_cores()
    training_args = training_arguments(args)  # initialises the process group (gloo on CPU, NCCL on GPU)
    plugin = start_plugin(args)

    if args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(args))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    else:
        tokenizer = ByteTokenizer()
        pad_id = tokenizer.pad_token_id
    if args.train_file:
        train_set, eval_set = own_documents(args, tokenizer, training_args)
    else:
        train_set = passkey_dataset(tokenizer, args.num_train_examples, args.seq_len, seed=args.seed)
        eval_set = passkey_dataset(tokenizer, args.num_eval_examples, args.seq_len, seed=args.seed + 1)
    if args.generate_eval:
        callbacks = [*(callbacks or []), PasskeyGenerationEval([eval_set[i] for i in range(args.generate_eval)])]

    attn = args.attn_implementation or ("ring_flash" if args.cp_size > 1 else "sdpa")
    transformers.set_seed(args.seed)  # the same initial weights on every rank and in every run
    model = build_model(args, tokenizer, attn, training_args)
    if args.offload_checkpoints:
        hf_ring.enable_offloaded_checkpointing(model)
    if args.tiled_mlp:
        hf_ring.tile_mlps(model, args.tiled_mlp)
    if args.lora_r:
        model = with_lora(model, args)
    if args.stock_trainer:
        return train_and_report(_stock_trainer(model, training_args, train_set, eval_set, plugin, pad_id, args,
                                               callbacks), args, tokenizer)

    trainer = hf_ring.RingTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set if evaluates(args) else None,
        # A router load-balancing loss counts the tokens an attention_mask marks, as the stock collator's.
        data_collator=plugin.make_collator(pad_token_id=pad_id, packing=args.packing,
                                           pad_to_multiple_of=args.pad_to_multiple_of,
                                           return_attention_mask=router_balance_of(model) is not None),
        ring_plugin=plugin,
        callbacks=callbacks,
        chunked_loss=hf_ring.ChunkedLossConfig(
            enabled={"auto": None, "on": True, "off": False}[args.chunked_loss], chunk_tokens=args.loss_chunk_tokens
        ),
    )
    return train_and_report(trainer, args, tokenizer)


def own_documents(args: argparse.Namespace, tokenizer, training_args: TrainingArguments, suffix: str = ""):
    """``--train_file``'s documents (and ``--eval_file``'s or the held-out share, else None),
    each tokenized whole (``suffix`` appended to its text), truncated to ``--seq_len``; says on
    the main process what it read."""
    train_docs, eval_docs = file_sets(args.train_file, args.eval_file, args.eval_share, args.seed)
    train_set, cut = tokenized_documents(train_docs, tokenizer, args.seq_len, suffix)
    eval_set, eval_cut = (tokenized_documents(eval_docs, tokenizer, args.seq_len, suffix) if eval_docs is not None
                          else (None, 0))
    if training_args.process_index == 0:
        lengths = sorted(len(ids) for ids in train_set["input_ids"])
        held = (f"; eval: {len(eval_set)} documents ({eval_cut} truncated)" if eval_set is not None
                else "; no evaluation (--eval_file or --eval_share for one)")
        print(f"[hf_ring] train_file {args.train_file}: {len(train_set)} documents, {sum(lengths)} tokens, "
              f"median {lengths[len(lengths) // 2]}, longest {lengths[-1]}, {cut} truncated to --seq_len "
              f"{args.seq_len}{held}", flush=True)
    return train_set, eval_set


def lora_config(args: argparse.Namespace):
    """PEFT's ``LoraConfig`` of rank ``--lora_r`` on ``--lora_modules``, ``--lora_dropout``."""
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=args.lora_dropout,
                      target_modules=args.lora_modules.split(","))


def with_lora(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``model`` with a LoRA adapter of rank ``--lora_r`` on ``--lora_modules`` (PEFT)."""
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(args))
    if args.lora_init_seed is not None:
        _seed_lora_a(model, args.lora_init_seed)
    return model


def _seed_lora_a(model: torch.nn.Module, seed: int) -> None:
    """Every ``lora_A`` weight drawn as PEFT draws it on one process (uniform, bound
    ``1 / sqrt(in_features)``), from a generator seeded by ``seed`` and the weight's name; a
    split one (a DTensor beside TP) keeps its part of the whole draw."""
    import zlib

    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" not in name:
                continue
            generator = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            bound = param.shape[1] ** -0.5
            whole = (torch.rand(param.shape, generator=generator) * 2 - 1) * bound
            whole = whole.to(param.dtype)
            param.copy_(distribute_tensor(whole, param.device_mesh, param.placements)
                        if isinstance(param, DTensor) else whole)


def _stock_trainer(model, training_args, train_set, eval_set, plugin, pad_id, args,
                   callbacks: Optional[list] = None) -> transformers.Trainer:
    """Plain transformers: the stock Trainer, the model computing its own loss from ``labels``
    (padded with -100) and a right-padding ``attention_mask``; the rows padded as hf_ring's
    collator pads them, so that both see the same batches."""
    ring = plugin.make_collator(pad_token_id=pad_id, return_attention_mask=True, pad_to_multiple_of=args.pad_to_multiple_of)

    def collate(features):
        batch = ring(features)
        return {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}

    return transformers.Trainer(model=model, args=training_args, train_dataset=train_set,
                                eval_dataset=eval_set if evaluates(args) else None,
                                data_collator=collate, callbacks=callbacks)


def train_and_report(trainer: transformers.Trainer, args: argparse.Namespace, tokenizer=None) -> dict:
    """Train, evaluate at the end unless the last step just did, write trainer_state.json, save
    the final model (unless ``--no_save_model``; ``tokenizer``: saved beside it when it is a
    Hugging Face tokenizer the trainer does not hold already), shut down."""
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    if getattr(trainer, "deepspeed_engine_summary", None) is not None:
        print(f"[hf_ring] rank {trainer.args.process_index}: {trainer.deepspeed_engine_summary.describe()}", flush=True)
    # transformers 5 evaluates at the last step itself (4.57 only at multiples of eval_steps):
    # read whether it did rather than guess from the step count.
    final = trainer.state.global_step
    evaluated_last_step = any("eval_loss" in e and e.get("step") == final for e in trainer.state.log_history)
    if evaluates(args) and not evaluated_last_step:
        metrics.update(trainer.evaluate())
    else:
        metrics.update({k: v for e in trainer.state.log_history if "eval_loss" in e for k, v in e.items()})
    trainer.save_state()  # writes output_dir/trainer_state.json (log_history: loss per step, eval_loss)
    if not getattr(args, "no_save_model", False):
        _save_final_model(trainer, args.output_dir)
        if (tokenizer is not None and getattr(trainer, "processing_class", None) is None
                and hasattr(tokenizer, "save_pretrained") and trainer.is_world_process_zero()):
            tokenizer.save_pretrained(args.output_dir)  # the byte tokenizer has nothing to save: made on the spot
        if trainer.is_world_process_zero():
            print(f"[hf_ring] final model saved in {args.output_dir}", flush=True)
    if trainer.is_world_process_zero():
        if getattr(trainer, "gradient_reduction", None) is not None:  # RingTrainer's (the stock Trainer has none)
            print(f"[hf_ring] {trainer.gradient_reduction.describe()}", flush=True)
        print(f"[hf_ring] done: train_loss {metrics.get('train_loss')}, eval_loss {metrics.get('eval_loss')}; "
              f"log in {os.path.join(args.output_dir, 'trainer_state.json')}", flush=True)
    _shut_down(trainer)
    return metrics


def _save_final_model(trainer: transformers.Trainer, output_dir: str) -> None:
    """The final model in ``output_dir`` as ``from_pretrained`` reads it (a LoRA run: its
    adapter alone), every rank taking part. The Trainer gathers ZeRO-3's and TP's weights
    itself, but under FSDP with a sharded state dict (the example's, for its checkpoints) its
    ``save_model`` writes nothing: the whole weights are gathered here instead."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) and "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        state_dict = trainer.accelerator.get_state_dict(trainer.model)  # collective: the whole weights
        if trainer.args.should_save:
            trainer.accelerator.unwrap_model(trainer.model).save_pretrained(output_dir, state_dict=state_dict)
    else:
        trainer.save_model()


def _shut_down(trainer: transformers.Trainer) -> None:
    """Free the DDP (or FSDP2) model, then destroy the process groups, in that order.

    Left to interpreter exit, gloo's worker threads can abort a process after a successful
    run; and if the DDP reducer is the last holder of a gloo group, its destructor joins
    those threads while holding the GIL that they need (a PyTorch issue), which hangs.
    """
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model = None
    gc.collect()
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
