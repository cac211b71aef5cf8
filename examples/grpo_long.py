"""Reinforcement learning (GRPO, RLOO) with TRL's GRPOTrainer / RLOOTrainer and context parallelism.

    # CPU, 2 processes, one CP group of 2:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/grpo_long.py --cp_size 2
    # the same run in one process (what the CP run must log, step by step):
    python examples/grpo_long.py --cp_size 1
    # TRL's own GRPOTrainer, one process (what RingGRPOTrainer at cp 1 must log):
    python examples/grpo_long.py --stock_trainer
    # RLOO instead of GRPO (--beta: its KL penalty in the reward):
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/grpo_long.py --cp_size 2 --algorithm rloo
    # 8 GPUs, 2 data-parallel x 4 context-parallel, a real checkpoint, long rollouts:
    accelerate launch --config_file examples/accelerate_gpu.yaml examples/grpo_long.py \\
        --cp_size 4 --model_name_or_path /path/to/llama --max_completion_length 16384 --bf16

Default: a tiny Llama initialised on the spot (saved under --output_dir, so that TRL can build
the reference model from it when --beta > 0), the byte-level tokenizer of the TRL examples
(examples/trl_data.py) and synthetic prompts "key 4821 copy:", rewarded per digit of the key
the completion copies (rule-checked, see copy_reward). Each CP group's rollouts are
generated once, without CP, on its first rank; the policy, old-policy and reference
log-probabilities and the backward run through the ring. The reward is logged at every
step (``reward``, ``rewards/copy_reward/mean``). At the defaults, runs at cp 1 and cp 2 with
the same --seed sample the same completions, so their logs compare step by step.
--lora_r trains a LoRA adapter through TRL's peft_config (its reference: the adapter disabled).
--packing passes padding_free=True: each step's prompt + completion rows run as one packed row of
documents (each padded to 2 x cp_size only, not to the longest rollout).
--generate_under_cp: the group's ranks generate together under CP instead (the prompt's cache
sharded over the group; the same completions).
--fsdp full_shard shards the weights with FSDP2 (at cp 2 too: every process unshards the policy
for the group's first rank to generate, then reshards).
The fine-tune example's flags apply (see finetune_llama_long.py), plus those below.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Optional, Sequence

import datasets
import torch
import transformers
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_llama_long import (  # noqa: E402
    build_model, build_parser, parse_args as parse_shared_args, share_cores, start_plugin, train_and_report,
)
from finetune_llama_long import lora_config, refuse_memory_options, training_arguments  # noqa: E402
from trl_data import load_chat_tokenizer  # noqa: E402

from hf_ring.trl import RingGRPOTrainer, RingRLOOTrainer  # noqa: E402

KEY_DIGITS = 4


def parse_args(argv: Optional[Sequence[str]] = None):
    p = build_parser(__doc__)
    # 60 steps of 16 rollouts (4 prompts x 4): the mean reward goes from 0 to about 0.3 (digits, some in place).
    p.set_defaults(output_dir="output/grpo_long", learning_rate=5e-3, max_steps=60, seq_len=64, hidden_size=64,
                   per_device_train_batch_size=16, num_train_examples=256, num_eval_examples=0)
    p.add_argument("--algorithm", default="grpo", choices=["grpo", "rloo"])
    p.add_argument("--loss_type", default=None,
                   help="--algorithm grpo: TRL's GRPO loss type (default grpo; dapo, dr_grpo, bnpo, ...)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: a reference model)")
    p.add_argument("--num_generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--max_completion_length", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num_iterations", type=int, default=1,
                   help="updates per generation (> 1: old-policy log-probs, clipping)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--generate_under_cp", action="store_true",
                   help="each CP group's ranks generate its rollouts together under CP (a sharded prefill) instead "
                        "of its first rank alone without CP")
    args = parse_shared_args(argv, p)
    refuse_memory_options(p, args, "TRL's fused LM head computes the per-token log-probabilities by chunks; "
                                   "offloaded checkpoints and the tiled MLP are not wired into this example")
    if args.algorithm == "rloo" and args.loss_type is not None:
        p.error("--loss_type is GRPO's; RLOO has one loss")
    if args.stock_trainer and args.cp_size != 1:
        p.error("--stock_trainer is TRL's own GRPOTrainer: --cp_size 1")
    if args.num_eval_examples:
        p.error("--num_eval_examples: evaluation is not wired into the GRPO example (refused under CP)")
    return args


def copy_prompts(num_examples: int, seed: int) -> datasets.Dataset:
    """Prompts ``"key 4821 copy:"`` (all of one length, so that no prompt is padded) and their keys."""
    rng = random.Random(seed + 104729)
    keys = ["".join(rng.choice("0123456789") for _ in range(KEY_DIGITS)) for _ in range(num_examples)]
    return datasets.Dataset.from_dict({"prompt": [f"key {k} copy:" for k in keys], "key": keys})


def copy_reward(prompts: list, completions: list, key: list, **kwargs) -> list[float]:
    """Per completion: the mean over the key's digits of 1 for the right digit at its place,
    0.25 for another digit there, 0 otherwise (leading spaces skipped)."""
    rewards = []
    for completion, k in zip(completions, key):
        text = completion.lstrip()[:KEY_DIGITS]
        score = sum(1.0 if c == d else 0.25 if c.isdigit() else 0.0 for c, d in zip(text, k))
        rewards.append(score / KEY_DIGITS)
    return rewards


def rl_config(args) -> GRPOConfig | RLOOConfig:
    """The fine-tune example's training arguments as a GRPOConfig (--algorithm grpo) or an
    RLOOConfig, plus their options."""
    settings = training_arguments(args).to_dict()  # initialises the process group
    if args.algorithm == "grpo":
        settings["loss_type"] = args.loss_type or "grpo"
    settings.update(
        beta=args.beta,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        steps_per_generation=1,
        num_iterations=args.num_iterations,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=False,  # TRL's default is True (autocast, on CPU too); --bf16 loads the weights in bfloat16 instead
        log_completions=False,
        remove_unused_columns=False,  # the reward reads the "key" column
    )
    return (GRPOConfig if args.algorithm == "grpo" else RLOOConfig)(**settings)


def initial_policy(args, tokenizer, attn: str, config: GRPOConfig | RLOOConfig) -> torch.nn.Module:
    """The policy, loaded from a path (TRL builds the reference model from the policy's path):
    the checkpoint's, or the default model saved under ``--output_dir`` by the first process."""
    if args.model_name_or_path:
        return build_model(args, tokenizer, attn, config)
    path = os.path.join(args.output_dir, "initial_policy")
    if config.process_index == 0:
        transformers.set_seed(args.seed)  # the same initial weights in every run
        build_model(args, tokenizer, "sdpa", config).save_pretrained(path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)


def build_trainer(args, config: GRPOConfig | RLOOConfig, plugin=None):
    """``RingGRPOTrainer`` / ``RingRLOOTrainer`` (TRL's ``GRPOTrainer`` / ``RLOOTrainer`` with
    --stock_trainer) on the copy task."""
    tokenizer = load_chat_tokenizer(args.model_name_or_path, args.tokenizer_name)
    # --packing: ring_flash keeps the packed documents apart, at cp 1 too.
    attn = args.attn_implementation or ("ring_flash" if args.cp_size > 1 or args.packing else "sdpa")
    model = initial_policy(args, tokenizer, attn, config)
    # --lora_r: TRL wraps the policy with the adapter; its reference (beta > 0) is the policy with the adapter off.
    common = dict(model=model, reward_funcs=copy_reward, args=config,
                  train_dataset=copy_prompts(args.num_train_examples, args.seed), processing_class=tokenizer,
                  peft_config=lora_config(args) if args.lora_r else None)
    if args.stock_trainer:
        return (GRPOTrainer if args.algorithm == "grpo" else RLOOTrainer)(**common)
    return (RingGRPOTrainer if args.algorithm == "grpo" else RingRLOOTrainer)(**common, ring_plugin=plugin,
                                                                           padding_free=args.packing,
                                                                           generate_under_cp=args.generate_under_cp)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    share_cores()
    config = rl_config(args)
    plugin = None if args.stock_trainer else start_plugin(args)
    return train_and_report(build_trainer(args, config, plugin), args)


if __name__ == "__main__":
    main()
