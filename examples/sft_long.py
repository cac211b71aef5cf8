"""Supervised fine-tuning at long context with TRL's SFTTrainer and context parallelism.

    # CPU, 2 processes, one CP group of 2, conversations with assistant-only loss:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_long.py --cp_size 2
    # TRL's best-fit packing, each document zigzag-sharded on its own:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_long.py --cp_size 2 --packing
    # your own documents (JSON lines / parquet / text, a 'text' column), 5 % held out for eval_loss:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_long.py --cp_size 2 \\
        --train_file data/mix.jsonl --eval_share 0.05 --packing
    # a LoRA adapter through TRL's peft_config (saved in --output_dir); --stock_trainer: TRL alone, cp 1:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/sft_long.py --cp_size 2 --lora_r 8
    # 8 GPUs, 2 data-parallel x 4 context-parallel, a real checkpoint:
    accelerate launch --config_file examples/accelerate_gpu.yaml examples/sft_long.py \\
        --cp_size 4 --seq_len 65536 --model_name_or_path /path/to/llama --bf16

Default: a tiny Llama initialised on the spot, a byte-level Hugging Face tokenizer with a
chat template (examples/trl_data.py) and synthetic passkey-retrieval conversations, so
nothing is downloaded. TRL prepares the data (chat template, loss masks, packing);
hf_ring.training.trl.RingSFTTrainer trains on it with the sequence split over --cp_size processes.
The fine-tune example's flags apply (see finetune_llama_long.py), plus those below.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

import transformers
from trl import SFTConfig, SFTTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_llama_long import (  # noqa: E402
    add_own_data_flags, build_model, build_parser, evaluates, own_documents, parse_args as parse_shared_args,
    share_cores, start_plugin, train_and_report,
)
from finetune_llama_long import lora_config, refuse_memory_options, training_arguments  # noqa: E402
from trl_data import FORMATS, load_chat_tokenizer, sft_dataset  # noqa: E402

from hf_ring.trl import RingSFTTrainer  # noqa: E402

# Room for the chat template's tokens around a --seq_len example.
TEMPLATE_ROOM = 64


def parse_args(argv: Optional[Sequence[str]] = None):
    p = add_own_data_flags(build_parser(__doc__))
    p.set_defaults(output_dir="output/sft_long")
    p.add_argument("--dataset_format", default=None, choices=FORMATS,
                   help="the synthetic set's format: messages (default): conversations, assistant-only loss; "
                        "prompt_completion: completion-only loss; text: the whole text. With --train_file: text "
                        "(each document whole, TRL's end-of-text token appended, loss on every token)")
    p.add_argument("--packing_strategy", default="bfd", choices=["bfd", "bfd_split", "wrapped"],
                   help="TRL's packing strategy with --packing (bfd: documents kept whole and apart)")
    p.add_argument("--packed_length", type=int, default=0,
                   help="with --packing: tokens per packed row (default: room for two examples)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    args = parse_shared_args(argv, p)
    if args.train_file and args.dataset_format not in (None, "text"):
        p.error(f"--dataset_format {args.dataset_format} with --train_file: its documents are plain text (a 'text' "
                "column), trained on whole")
    args.dataset_format = args.dataset_format or ("text" if args.train_file else "messages")
    refuse_memory_options(p, args, "RingSFTTrainer computes its loss with TRL's fused LM head; offloaded checkpoints "
                          "and the tiled MLP are not wired into this example")
    return args


def sft_config(args) -> SFTConfig:
    """The fine-tune example's training arguments as an SFTConfig, plus TRL's data options.

    Each example (at most --seq_len tokens, plus the chat template's) is a row of its own, or
    with --packing a document that TRL packs with others into rows of --packed_length tokens.
    """
    max_length = args.seq_len + TEMPLATE_ROOM
    if args.packing:
        max_length = args.packed_length or 2 * max_length
    settings = training_arguments(args).to_dict()  # initialises the process group
    settings.update(
        max_length=max_length,
        packing=args.packing,
        packing_strategy=args.packing_strategy,
        assistant_only_loss=args.dataset_format == "messages",
        gradient_checkpointing=args.gradient_checkpointing,
        dataset_num_proc=None,
    )
    return SFTConfig(**settings)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    share_cores()
    config = sft_config(args)
    plugin = start_plugin(args)

    tokenizer = load_chat_tokenizer(args.model_name_or_path, args.tokenizer_name)
    if args.train_file:
        # Tokenized here as TRL tokenizes a text (its end-of-text token appended), each document truncated
        # to --seq_len; TRL takes input_ids and labels as they are and packs whole documents.
        train_set, eval_set = own_documents(args, tokenizer, config, suffix=tokenizer.eos_token)
    else:
        train_set = sft_dataset(args.dataset_format, args.num_train_examples, args.seq_len, seed=args.seed)
        eval_set = sft_dataset(args.dataset_format, args.num_eval_examples, args.seq_len, seed=args.seed + 1)

    attn = args.attn_implementation or ("ring_flash" if args.cp_size > 1 else "sdpa")
    transformers.set_seed(args.seed)  # the same initial weights on every rank and in every run
    model = build_model(args, tokenizer, attn, config)

    # --lora_r: TRL wraps the model with PEFT itself (its peft_config), as without hf_ring.
    peft = {"peft_config": lora_config(args)} if args.lora_r else {}
    # --stock_trainer: TRL's own SFTTrainer, what hf_ring's runs are compared against.
    trainer_cls, ring = (SFTTrainer, {}) if args.stock_trainer else (RingSFTTrainer, {"ring_plugin": plugin})
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=train_set,
        eval_dataset=eval_set if evaluates(args) else None,
        processing_class=tokenizer,
        **peft,
        **ring,
    )
    return train_and_report(trainer, args)


if __name__ == "__main__":
    main()
