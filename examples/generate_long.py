"""Answer a long-context retrieval prompt with context parallelism: the prompt prefilled by the
ring over the CP group, each rank holding its shard of the KV cache, the answer decoded
against every shard.

    # CPU, 2 processes, one CP group of 2:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/generate_long.py --cp_size 2
    # a model fine-tuned by examples/finetune_llama_long.py (it saves its final model in its
    # --output_dir, by default output/finetune_llama_long), a longer prompt:
    accelerate launch --config_file examples/accelerate_cpu.yaml examples/generate_long.py --cp_size 2 \\
        --model_name_or_path output/finetune_llama_long --prompt_tokens 8192
    # gather the cache onto every rank after the prefill, then decode locally:
    ... examples/generate_long.py --cp_size 2 --decode gathered

The prompt is a passkey-retrieval prompt (examples/long_context_data.py, the fine-tuning
example's task: a key hidden in filler text, asked for at the end), tokenized byte by byte.
The default model is a small Llama initialised on the spot (nothing downloaded), which has
not learnt the task: its answer is not the key, but it is the answer one process gives,
which the first rank verifies against a run without CP (``--no_check`` skips it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Optional, Sequence

import torch
import transformers
from accelerate import PartialState
from packaging.version import Version
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_ring

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_llama_long import share_cores  # noqa: E402
from long_context_data import ByteTokenizer, passkey_example  # noqa: E402

CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5") else "past_key_values"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp_size", type=int, default=2, help="processes sharing one prompt (default 2)")
    ap.add_argument("--model_name_or_path", default=None,
                    help="a checkpoint saved by examples/finetune_llama_long.py (default: a small Llama made here)")
    ap.add_argument("--prompt_tokens", type=int, default=2048, help="the prompt's length at most (default 2048)")
    ap.add_argument("--max_new_tokens", type=int, default=8)
    ap.add_argument("--decode", choices=hf_ring.hf.generation.DECODE_MODES, default="sharded",
                    help="sharded: attend every rank's share per token; gathered: gather the cache once, "
                         "decode locally")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no_check", action="store_true", help="skip the comparison with one process on the first rank")
    return ap


def _model(args: argparse.Namespace, tokenizer: ByteTokenizer) -> torch.nn.Module:
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path, attn_implementation="ring_flash")
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * args.prompt_tokens,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config, attn_implementation="ring_flash")


def _generate(model, prompt: torch.Tensor, args: argparse.Namespace, cache=None) -> torch.Tensor:
    # transformers 5 names the cache `cache`, 4.57 `past_key_values`; use_cache=True because
    # the configs the fine-tuning example saves turn the cache off for training.
    kwargs = {CACHE_KWARG: cache} if cache is not None else {}
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.max_new_tokens,
                          do_sample=False, use_cache=True, **kwargs)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = build_parser().parse_args(argv)
    PartialState()  # starts the process group accelerate launched
    share_cores()  # the launchers' one thread per process becomes each one's share; the user's count stands
    state = hf_ring.RingAttentionPlugin(cp_size=args.cp_size).setup()
    tokenizer = ByteTokenizer()
    example = passkey_example(tokenizer, random.Random(args.seed), args.prompt_tokens)
    prompt_ids = [t for t, label in zip(example["input_ids"], example["labels"]) if label == -100]
    prompt = torch.tensor([prompt_ids])
    model = _model(args, tokenizer).eval()
    cache = hf_ring.ShardedCache(decode=args.decode)
    start = time.perf_counter()
    out = _generate(model, prompt, args, cache)
    seconds = time.perf_counter() - start
    answer = tokenizer.decode(out[0, prompt.shape[1]:].tolist())
    expected = tokenizer.decode(example["input_ids"][len(prompt_ids):])
    report = {"prompt_tokens": prompt.shape[1], "cp_size": state.cp_size, "seconds": seconds, "answer": answer,
              "new_token_ids": out[0, prompt.shape[1]:].tolist(),
              "expected": expected, "cache_entries_here": sum(layer.columns.numel() for layer in cache.layers)}
    if state.cp_rank == 0 and not args.no_check:
        with hf_ring.context_parallel_suspended():
            alone = _generate(model, prompt, args)
        report["same_as_one_process"] = bool(torch.equal(alone, out))
        if not report["same_as_one_process"]:
            raise RuntimeError(f"generation under CP gave {out[0, prompt.shape[1]:].tolist()}, one process "
                               f"{alone[0, prompt.shape[1]:].tolist()}")
    print(f"[rank {state.cp_rank}] {report}", flush=True)
    return report


if __name__ == "__main__":
    main()
