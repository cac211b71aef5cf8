"""Fine-tune an image-text model (Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3) on many images per sample with
context parallelism, and compare it with plain transformers.

At ``--cp_size 1`` this runs the **stock** model (``sdpa``) with the **stock**
``transformers.Trainer``, the model computing its own loss from ``labels``; at
``--cp_size N`` it runs ``attn_implementation="ring_flash"`` with ``hf_ring.RingTrainer``
and ``RingVisionDataCollator`` (every rank of a CP group gets the same full batch, images
included; only the labels are sharded). Both log the same losses, gradient norms and eval
loss (tests/test_trainer_vlm.py).

    # CPU, one process: the stock Trainer
    python examples/finetune_vlm_long.py --model_type qwen2_5_vl
    # CPU, 2 processes, one CP group of 2
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/finetune_vlm_long.py \\
        --model_type qwen2_5_vl --cp_size 2
    # 8 GPUs, 2 data-parallel x 4 context-parallel, a real checkpoint and its processor
    accelerate launch --config_file examples/accelerate_gpu.yaml examples/finetune_vlm_long.py \\
        --cp_size 4 --seq_len 32768 --model_name_or_path /path/to/Qwen2.5-VL --bf16

Default: a tiny model of ``--model_type`` made on the spot and samples of drawn shapes with
their captions (examples/vlm_data.py; Qwen2.5-VL's include a short video), nothing
downloaded. The flags are finetune_llama_long.py's (``--seq_len`` is a sample's longest
length in tokens, images included), plus ``--model_type``. With ``--packing`` each batch's
samples (``--per_device_train_batch_size`` of them) go into one row, each a document with its
own images and the model's own positions for it alone (``RingVisionDataCollator(packing=True)``);
at ``--cp_size 1`` the stock model reads the documents from its positions (no cache: its text
config's ``use_cache`` is set False), as transformers' own packed rows.

With ``--model_name_or_path`` (a Qwen-VL checkpoint; other families are refused) the drawn
samples are made by the checkpoint's processor (``AutoProcessor``; ``--trust_remote_code``
where its class is the checkpoint's own code), sized in its tokenizer's tokens, with every
token id read from the checkpoint; run on a local checkpoint of the tiny Qwen2.5-VL and a
real processor (tests/test_trainer_vlm.py), not on a released one.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

import torch
import transformers
from transformers import AutoModelForImageTextToText, Trainer

import hf_ring

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_llama_long import (  # noqa: E402
    build_parser, parse_args, share_cores, start_plugin, train_and_report, training_arguments,
)
from vlm_data import Layout, WordTokenizer, shapes_dataset  # noqa: E402
from vlm_models import MODEL_TYPES, init_untrained  # noqa: E402

# finetune_llama_long.py's flags that do not apply here, with why.
NOT_APPLIED = {
    "deepspeed": "DeepSpeed is not tested with image-text models yet: use --fsdp, or no weight sharding",
    "offload_checkpoints": "offloaded checkpoints are not tested with image-text models yet",
    "tiled_mlp": "the tiled MLP is not tested with image-text models yet",
    "config_name": "the tiny model is chosen with --model_type",
    "vocab_size": "the tiny model's vocabulary is the word tokenizer's",
    "lora_r": "LoRA is tested with the text example (examples/finetune_llama_long.py) only",
    "stock_trainer": "at --cp_size 1 this example runs the stock Trainer already",
    "tokenizer_name": "the checkpoint's processor (AutoProcessor) holds its tokenizer: save both in one folder",
}


def build_vlm_parser() -> argparse.ArgumentParser:
    p = build_parser(__doc__)
    p.add_argument("--model_type", default="qwen2_5_vl", choices=sorted(MODEL_TYPES),
                   help="the tiny default model's family (ignored with --model_name_or_path)")
    p.add_argument("--trust_remote_code", action="store_true",
                   help="--model_name_or_path: run the checkpoint's own code for its processor (or model) where "
                        "transformers has no class of that name")
    p.set_defaults(seq_len=256, hidden_size=64, max_steps=40, learning_rate=1e-3, num_train_examples=64,
                   num_eval_examples=6, eval_steps=20, output_dir="output/finetune_vlm_long")
    return p


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name, why in NOT_APPLIED.items():
        if getattr(args, name) not in (None, False, 0):
            parser.error(f"--{name}: {why}")
    if args.trust_remote_code and not args.model_name_or_path:
        parser.error("--trust_remote_code applies to --model_name_or_path only")
    if args.fsdp and args.cp_size == 1 and not torch.cuda.is_available():
        parser.error("--fsdp with --cp_size 1 runs the stock Trainer, whose FSDP accelerate drops on CPU without a "
                     "word; shard the weights at --cp_size 2 or more (RingTrainer keeps FSDP2 on CPU), or on GPUs")


def _checkpoint(args: argparse.Namespace, attn: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, Layout, dict]:
    """A checkpoint, its processor, the pixel layout of its samples and its token ids, every id
    read from the checkpoint (its config's placeholders, its tokenizer's padding)."""
    from transformers import AutoConfig, AutoProcessor, ProcessorMixin

    path, remote = args.model_name_or_path, args.trust_remote_code
    config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
    vision = getattr(config, "vision_config", None)
    if not hasattr(vision, "spatial_merge_size"):
        raise NotImplementedError(f"--model_name_or_path: a {config.model_type} checkpoint, whose vision config has no "
                                  "spatial_merge_size; the samples are sized by Qwen-VL's patch arithmetic only (other "
                                  "processors' placeholders are not sized yet): train the tiny --model_type instead")
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=remote)
    if not isinstance(processor, ProcessorMixin) or getattr(processor, "image_processor", None) is None:
        # AutoProcessor gives a bare tokenizer where it finds no processor class it can load.
        raise ValueError(f"AutoProcessor.from_pretrained({path!r}) gave a {type(processor).__name__}, not a processor "
                         "with an image processor: the checkpoint needs its processor's files (processor_config.json "
                         "or preprocessor_config.json), and --trust_remote_code where its processor class is not "
                         "transformers' own")
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=attn, dtype=dtype,
                                                        trust_remote_code=remote)
    for name in ("image_token_id", "video_token_id"):
        theirs = getattr(processor, name, None)
        if theirs is not None and theirs != getattr(config, name, None):
            raise ValueError(f"the processor's {name} is {theirs} but the checkpoint's config says "
                             f"{getattr(config, name, None)}: the two are not one checkpoint's")
    # Qwen-VL's patch arithmetic: images of 4 x 4 merged patches (16 placeholders each, as the tiny
    # model's), which a processor that resizes to multiples of patch x merge keeps at their size.
    patch, merge = vision.patch_size, vision.spatial_merge_size
    layout = Layout("qwen", 4 * merge * patch, patch=patch, merge=merge, temporal=vision.temporal_patch_size,
                    video=getattr(processor, "video_processor", None) is not None)
    print(f"[hf_ring] checkpoint {args.model_name_or_path}: {type(model).__name__}, processor "
          f"{type(processor).__name__} (images: {type(processor.image_processor).__name__}, videos: "
          f"{type(getattr(processor, 'video_processor', None)).__name__}), image_token_id {config.image_token_id}",
          flush=True)
    pad = processor.tokenizer.pad_token_id
    ids = dict(pad_token_id=pad if pad is not None else processor.tokenizer.eos_token_id,
               image_token_id=config.image_token_id, video_token_id=getattr(config, "video_token_id", None),
               spatial_merge_size=merge)
    return model, processor, layout, ids


def _model_and_data(args: argparse.Namespace, attn: str) -> tuple[torch.nn.Module, dict, list, list]:
    """The model, its token ids (pad, image, video, merge) and the train and eval sets."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tok = WordTokenizer()
    if args.model_name_or_path:
        model, processor, layout, ids = _checkpoint(args, attn, dtype)
    else:
        processor = None
        config, layout = MODEL_TYPES[args.model_type](tok, args.hidden_size, args.num_layers, args.seq_len)
        transformers.set_seed(args.seed)  # the same initial weights on every rank and in every run
        model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn).to(dtype)
        init_untrained(model)
        ids = dict(pad_token_id=tok.pad_token_id, image_token_id=tok.image_token_id,
                   video_token_id=tok.video_token_id if layout.kind == "qwen" else None,
                   spatial_merge_size=layout.merge if layout.kind == "qwen" else None)
    train = shapes_dataset(tok, layout, args.num_train_examples, args.seq_len, seed=args.seed, processor=processor)
    evals = shapes_dataset(tok, layout, args.num_eval_examples, args.seq_len, seed=args.seed + 1, processor=processor)
    return model, ids, train, evals


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = build_vlm_parser()
    args = parse_args(argv, parser)
    _check_flags(parser, args)
    share_cores()
    training_args = training_arguments(args)  # initialises the process group (gloo on CPU, NCCL on GPU)
    attn = args.attn_implementation or ("ring_flash" if args.cp_size > 1 else "sdpa")
    common = {}
    if args.cp_size == 1:
        print(f"[hf_ring] rank {training_args.process_index}/{training_args.world_size} (dist_backend none): "
              f"the stock Trainer, attn_implementation={attn}", flush=True)
        trainer_class = Trainer
    else:
        plugin = start_plugin(args)
        trainer_class = hf_ring.RingTrainer
        common = dict(ring_plugin=plugin, chunked_loss=hf_ring.ChunkedLossConfig(
            enabled={"auto": None, "on": True, "off": False}[args.chunked_loss], chunk_tokens=args.loss_chunk_tokens))
    model, ids, train_set, eval_set = _model_and_data(args, attn)
    packing = dict(packing=True, model=model) if args.packing else {}
    if args.packing:
        # Training builds no cache; with one, stock transformers' mask would let packed
        # documents attend to each other (the collator refuses that at cp 1).
        model.config.get_text_config().use_cache = False
        print(f"[hf_ring] packing: the {args.per_device_train_batch_size} samples of a batch in one row, each a "
              "document with its own images and positions", flush=True)
    if hasattr(model.config, "vision_feature_layer"):
        # LLaVA-style models read a hidden layer of the tower (not its output): the layers
        # after it and the tower's final norm get no gradient, which DDP must be told.
        training_args.ddp_find_unused_parameters = True
    if args.cp_size == 1:
        collator = hf_ring.RingVisionDataCollator(**ids, model_labels=True, **packing)  # the model's own loss
    else:
        collator = plugin.make_vision_collator(**ids, **packing)
    trainer = trainer_class(
        model=model, args=training_args, train_dataset=train_set,
        eval_dataset=eval_set if args.num_eval_examples > 0 else None, data_collator=collator, **common,
    )
    return train_and_report(trainer, args)


if __name__ == "__main__":
    main()
