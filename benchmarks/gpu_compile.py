"""gpu_check.py's compile section: a ``ring_flash`` model's training step compiled against eager.

On one GPU there is no CP group, but a packed row runs the ring without one (each document
its own sequence: hf_ring.hf.compiled's op, the varlen kernel of ``backend="auto"``). A
Llama of ``layers`` decoder layers (bf16, 16 query heads over 8 KV heads of 128, a 32,768
vocabulary) trains on one packed row of ``row`` tokens (four documents of 1/2, 1/4, 1/8 and
1/8 of it), twice from the same weights: eagerly, and with each decoder layer compiled
(``layer.compile()``, torchtitan's recipe; the attention inside each is one custom op).
Per mode: the first step (the compile, for the compiled one) and the median of ``repeats``
steps after it, forward and backward, synchronised. Checked too: the compiled step's loss
and gradients against the eager ones (``pass``: bf16, the loss within 2e-2 relative and
the gradients, all parameters as one vector, within 5e-2: inductor fuses and reorders
bf16 sums over every layer), and that every compiled forward ran the ring's op in each
layer (a forward that fell back to eager Python does not).

``--dry-run-cpu``: 2 layers of hidden 64 in float32 on the CPU, aot_eager (inductor's
graphs without its code generation), a row of 64 tokens: the section's own code, not a figure.

Must not import hf_ring's training layers; it runs inside gpu_check's time budget.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

DRY = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, row=64, dtype=torch.float32, backend="aot_eager")
GPU = dict(layers=4, hidden=2048, heads=16, kv_heads=8, vocab=32768, row=8192, dtype=torch.bfloat16,
           backend="inductor")
LOSS_TOL, GRAD_TOL = 2e-2, 5e-2


def _model(size: dict, device: torch.device, state_dict=None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring  # noqa: F401  (registers ring_flash)

    config = LlamaConfig(hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["kv_heads"], vocab_size=size["vocab"],
                         max_position_embeddings=size["row"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_flash")
    model = model.to(device=device, dtype=size["dtype"]).train()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def _batch(size: dict, device: torch.device) -> dict:
    row = size["row"]
    lens = [row // 2, row // 4, row // 8, row - row // 2 - row // 4 - row // 8]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, size["vocab"], (1, row), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.cat([torch.cat([ids[0, a + 1:b], torch.tensor([-100])]) for a, b in zip(cu[:-1], cu[1:])])
    return {"input_ids": ids.to(device), "labels": labels.to(device), "max_length_q": max(lens),
            "max_length_k": max(lens), "position_ids": torch.cat([torch.arange(n) for n in lens])[None].to(device),
            "cu_seq_lens_q": cu.to(device), "cu_seq_lens_k": cu.to(device)}


def _step(model, batch: dict) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kwargs).logits
    loss = torch.nn.functional.cross_entropy(logits[0].float(), batch["labels"], ignore_index=-100)
    loss.backward()
    return loss.detach()


def _timed(model, batch: dict, device: torch.device, repeats: int, deadline: Any) -> dict:
    def once() -> tuple[float, torch.Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = _step(model, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, loss

    first, loss = once()
    times = []
    for _ in range(repeats):
        if deadline.spent():
            break
        times.append(once()[0])
    return {"first_s": first, "median_s": statistics.median(times) if times else None, "steps": len(times),
            "loss": loss}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compiled_step(device: torch.device, dry_run: bool, deadline: Any, result: dict, repeats: int) -> None:
    """Eager against compiled, into ``result`` (times, errors, ``pass``); ``result["skipped"]``
    when transformers is not installed (a GPU machine may have torch alone)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        result["skipped"] = "transformers is not installed"
        return
    from hf_ring.hf.compiled import OP_CALLS

    size = DRY if dry_run else GPU
    result["config"] = {k: str(v) for k, v in size.items()}
    batch = _batch(size, device)
    eager = _model(size, device)
    model = _model(size, device, eager.state_dict())
    for layer in model.model.layers:
        layer.compile(backend=size["backend"])
    result["eager"] = _timed(eager, batch, device, repeats, deadline)
    calls = sum(OP_CALLS.values())
    result["compiled"] = _timed(model, batch, device, repeats, deadline)
    forwards = 1 + result["compiled"]["steps"]
    result["op_calls_per_forward"] = (sum(OP_CALLS.values()) - calls) / forwards
    # The last step of each: the same weights (zero_grad, no optimizer), the same batch.
    eager_loss, loss = result["eager"].pop("loss"), result["compiled"].pop("loss")
    grads = [(p.grad.flatten(), q.grad.flatten()) for p, q in zip(model.parameters(), eager.parameters())]
    result["loss_rel_err"] = _rel(loss, eager_loss)
    result["grad_rel_err"] = _rel(torch.cat([g for g, _ in grads]), torch.cat([w for _, w in grads]))
    if result["eager"]["median_s"] and result["compiled"]["median_s"]:
        result["compiled_over_eager"] = result["compiled"]["median_s"] / result["eager"]["median_s"]
    result["pass"] = (result["loss_rel_err"] <= LOSS_TOL and result["grad_rel_err"] <= GRAD_TOL
                      and result["op_calls_per_forward"] == size["layers"])
    print(f"  eager {result['eager']['median_s']}s, compiled ({size['backend']}, each layer) "
          f"{result['compiled']['median_s']}s after a first step of {result['compiled']['first_s']:.1f}s; loss "
          f"{result['loss_rel_err']:.1e}, gradients {result['grad_rel_err']:.1e} off; ring op "
          f"{result['op_calls_per_forward']} per forward: {'PASS' if result['pass'] else 'FAIL'}", flush=True)
