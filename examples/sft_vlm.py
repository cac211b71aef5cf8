"""Supervised fine-tuning of an image-text model with TRL's SFTTrainer and context parallelism.

    # CPU, 2 processes, one CP group of 2, conversations with images:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_vlm.py --cp_size 2
    # what it is compared with: TRL's own SFTTrainer on one process
    python examples/sft_vlm.py --trl_reference
    # prompt-completion (completion-only loss, TRL's default for the format):
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_vlm.py --cp_size 2 \\
        --dataset_format prompt_completion

Default: a tiny Qwen2.5-VL made on the spot (examples/vlm_models.py), a real Qwen2.5-VL
processor of a word tokenizer and transformers' image processor, and conversations about drawn
shapes (examples/vlm_sft_data.py), nothing downloaded. TRL's vision collator runs the processor
on every batch and builds the labels (its completion-only or assistant-only masks);
hf_ring.trl.RingSFTTrainer hands the full batch to every rank of a CP group, the labels
sharded, and the language model runs as a ring over --cp_size processes. The fine-tune
example's flags apply where they make sense (see finetune_llama_long.py; --seq_len is TRL's
max_length), plus those below.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import torch
import transformers
from transformers import AutoModelForImageTextToText
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_llama_long import build_parser, parse_args as parse_shared_args, share_cores, start_plugin  # noqa: E402
from finetune_llama_long import train_and_report, training_arguments  # noqa: E402
from vlm_models import qwen2_5_vl  # noqa: E402
from vlm_sft_data import FORMATS, sft_vlm_dataset, shapes_processor, token_ids  # noqa: E402

import hf_ring  # noqa: E402,F401  registers attn_implementation="ring_flash"
from hf_ring.trl import RingSFTTrainer  # noqa: E402

NOT_APPLIED = ("model_name_or_path", "tokenizer_name", "config_name", "vocab_size", "packing", "offload_checkpoints",
               "tiled_mlp", "lora_r", "deepspeed", "stock_trainer", "loss_chunk_tokens")


def parse_args(argv: Optional[Sequence[str]] = None):
    p = build_parser(__doc__)
    p.set_defaults(output_dir="output/sft_vlm", seq_len=256, hidden_size=64, max_steps=20, learning_rate=1e-3,
                   num_train_examples=32, num_eval_examples=4, eval_steps=10)
    p.add_argument("--dataset_format", default="messages", choices=FORMATS,
                   help="messages: conversations (every token learned, the image placeholders too, as TRL does); "
                        "prompt_completion: completion-only loss")
    p.add_argument("--assistant_only_loss", action="store_true", help="messages: learn the assistant's turns only")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--trl_reference", action="store_true",
                   help="--cp_size 1 only: TRL's own SFTTrainer and the stock model (sdpa), the reference")
    args = parse_shared_args(argv, p)
    for name in NOT_APPLIED:
        if getattr(args, name) not in (None, False, 0):
            p.error(f"--{name}: not applied by this example (a tiny Qwen2.5-VL; TRL refuses packing with images)")
    if args.chunked_loss != "auto":
        p.error("--chunked_loss: RingSFTTrainer computes its loss with TRL's fused LM head")
    if args.trl_reference and args.cp_size != 1:
        p.error("--trl_reference runs TRL's own SFTTrainer on one process: --cp_size 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    share_cores()
    settings = training_arguments(args).to_dict()  # initialises the process group
    settings.update(max_length=args.seq_len, assistant_only_loss=args.assistant_only_loss,
                    gradient_checkpointing=args.gradient_checkpointing, dataset_num_proc=None,
                    bf16=args.bf16, ddp_find_unused_parameters=None)  # None: TRL decides for an image-text model
    config = SFTConfig(**settings)
    processor = shapes_processor()
    attn = args.attn_implementation or ("ring_flash" if args.cp_size > 1 else "sdpa")
    model_config, _ = qwen2_5_vl(token_ids(processor), args.hidden_size, args.num_layers, args.seq_len)
    transformers.set_seed(args.seed)  # the same initial weights on every rank and in every run
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForImageTextToText.from_config(model_config, attn_implementation=attn).to(dtype)
    common = dict(model=model, args=config, processing_class=processor,
                  train_dataset=sft_vlm_dataset(args.dataset_format, args.num_train_examples, seed=args.seed),
                  eval_dataset=sft_vlm_dataset(args.dataset_format, args.num_eval_examples, seed=args.seed + 1)
                  if args.num_eval_examples > 0 else None)
    if args.trl_reference:
        print(f"[hf_ring] rank 0/1 (dist_backend none): TRL's SFTTrainer, attn_implementation={attn}", flush=True)
        trainer = SFTTrainer(**common)
    else:
        trainer = RingSFTTrainer(**common, ring_plugin=start_plugin(args))
    return train_and_report(trainer, args)


if __name__ == "__main__":
    main()
