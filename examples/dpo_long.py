"""Preference tuning (DPO) at long context with TRL's DPOTrainer and context parallelism.

    # CPU, 2 processes, one CP group of 2:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/dpo_long.py --cp_size 2
    # 8 GPUs, 2 data-parallel x 4 context-parallel, a real checkpoint:
    accelerate launch --config_file examples/accelerate_gpu.yaml examples/dpo_long.py \\
        --cp_size 4 --seq_len 65536 --model_name_or_path /path/to/llama --bf16

Default: a tiny Llama initialised on the spot (the reference model is a copy of it), a
byte-level Hugging Face tokenizer with a chat template (examples/trl_data.py) and
synthetic passkey conversations where the right key is chosen and another rejected.
hf_ring.training.trl.RingDPOTrainer runs the policy and the reference through the ring; each
sequence's log-probability is summed over the whole CP group.
The fine-tune example's flags apply (see finetune_llama_long.py), plus those below.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Optional, Sequence

import transformers
from trl import DPOConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_llama_long import (  # noqa: E402
    build_model, build_parser, parse_args as parse_shared_args, share_cores, start_plugin, train_and_report,
)
from finetune_llama_long import refuse_memory_options, training_arguments  # noqa: E402
from trl_data import load_chat_tokenizer, preference_dataset  # noqa: E402

from hf_ring.trl import RingDPOTrainer  # noqa: E402

# Room for the chat template's tokens around a --seq_len prompt and its answer.
TEMPLATE_ROOM = 64


def parse_args(argv: Optional[Sequence[str]] = None):
    p = build_parser(__doc__)
    p.set_defaults(output_dir="output/dpo_long", learning_rate=1e-3)
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    p.add_argument("--loss_type", nargs="+", default=["sigmoid"], help="TRL's DPO loss type(s)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    args = parse_shared_args(argv, p)
    refuse_memory_options(p, args, "RingDPOTrainer computes its loss with TRL's fused LM head; offloaded checkpoints "
                          "and the tiled MLP are not wired into this example")
    if args.lora_r or args.stock_trainer:
        p.error("--lora_r and --stock_trainer are not wired into the DPO example (examples/sft_long.py has both)")
    return args


def dpo_config(args) -> DPOConfig:
    """The fine-tune example's training arguments as a DPOConfig, plus DPO's options."""
    settings = training_arguments(args).to_dict()  # initialises the process group
    settings.update(
        max_length=args.seq_len + TEMPLATE_ROOM,
        beta=args.beta,
        loss_type=args.loss_type,
        gradient_checkpointing=args.gradient_checkpointing,
        dataset_num_proc=None,
    )
    return DPOConfig(**settings)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    share_cores()
    config = dpo_config(args)
    plugin = start_plugin(args)

    tokenizer = load_chat_tokenizer(args.model_name_or_path, args.tokenizer_name)
    train_set = preference_dataset(args.num_train_examples, args.seq_len, seed=args.seed)
    eval_set = preference_dataset(args.num_eval_examples, args.seq_len, seed=args.seed + 1)

    attn = args.attn_implementation or ("ring_flash" if args.cp_size > 1 else "sdpa")
    transformers.set_seed(args.seed)  # the same initial weights on every rank and in every run
    model = build_model(args, tokenizer, attn, config)
    # A checkpoint's reference model is loaded by TRL from the same path; the default model's is a copy.
    ref_model = None if args.model_name_or_path else copy.deepcopy(model)

    trainer = RingDPOTrainer(
        model=model,
        ref_model=ref_model,
        args=config,
        train_dataset=train_set,
        eval_dataset=eval_set if args.num_eval_examples > 0 else None,
        processing_class=tokenizer,
        ring_plugin=plugin,
    )
    return train_and_report(trainer, args)


if __name__ == "__main__":
    main()
