"""What the random-draw mode costs a CP forward and backward that draws nothing.

Under context parallelism every guarded forward runs inside hf_ring's ``TorchFunctionMode``
(hf_ring/hf/randomness/draws.py), which looks at every torch call for a random draw. This
times a Llama training step (forward and backward, no dropout) at cp=2 on gloo, with the mode
put in force as usual ("mode") and with its entry replaced by a no-op ("off"), alternating,
the fastest of 3 rounds of 5 steps each, one thread per rank, and prints the ratio.

    python benchmarks/random_draws_overhead.py
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

def rank_main(rank: int, world: int, hidden: int, layers: int, seq: int) -> dict:
    """Seconds per step of one rank, by setting ("mode", "off")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_ring
    import hf_ring.hf.randomness.scope as scope

    torch.set_num_threads(1)
    hf_ring.setup_context_parallel(world)
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_flash").train()
    ids = hf_ring.shard_sequence(torch.randint(0, 256, (1, seq)), world, rank)
    positions = hf_ring.shard_sequence(torch.arange(seq)[None], world, rank)

    def step() -> None:
        model(input_ids=ids, position_ids=positions).logits.float().sum().backward()

    times: dict[str, list[float]] = {"mode": [], "off": []}
    enter = scope._enter
    try:
        for _ in range(3):
            for name in times:
                scope._enter = enter if name == "mode" else (lambda draws, module_id: None)
                step()
                start = time.perf_counter()
                for _ in range(5):
                    step()
                times[name].append((time.perf_counter() - start) / 5)
    finally:
        scope._enter = enter
    return {name: min(values) for name, values in times.items()}


if __name__ == "__main__":
    from distributed import run_world

    for hidden, layers, seq in [(64, 2, 64), (256, 4, 2048), (512, 4, 8192)]:
        r = run_world(2, rank_main, hidden, layers, seq)[0]
        print(f"hidden {hidden}, {layers} layers, {seq} tokens, cp 2: mode {r['mode'] * 1e3:.1f} ms, "
              f"off {r['off'] * 1e3:.1f} ms, ratio {r['mode'] / r['off']:.3f}", flush=True)
