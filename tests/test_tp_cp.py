"""Context parallelism beside transformers' tensor parallelism: tp2 x cp2 on 4 processes.

The model is loaded the Hugging Face way, ``from_pretrained(dir,
distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``: transformers' dense mesh
``(pp, dp_replicate, fsdp, tp)`` over 4 gloo ranks, TP innermost (ranks {0, 1} and {2, 3}
hold different heads), FSDP2 over the ``fsdp`` ranks {0, 2} and {1, 3}, which are hf_ring's CP
groups from ``setup_context_parallel(cp_size=2, tp_size=2)``: CP shards the sequence over
the ranks that FSDP shards the weights over (torchtitan's ``fsdp = dp_shard x cp``).

Compared with one process on the full sequence (SDPA, float32), for the ring, all-gather,
Ulysses and auto patterns (hybrid, which needs 4 CP ranks, is in tests/test_nd_cp.py), for
a packed row of two documents through the ring against each document alone, and for the
chunked loss on each TP rank's vocabulary rows (``ring_chunked``, 5 tokens per chunk):
every rank's logits of its shard (none for the chunked loss), the loss, and every
parameter's gradient (``grad.full_tensor()``). Each CP rank's loss is its share of the
token mean times 2, since FSDP2 averages gradients over its 2 ranks. Tolerance 2e-5
relative to the largest value: float32 on a tiny model, the attention summed over two ring
steps and TP's partial sums in other orders (measured: logits 2.1e-7, loss 7.4e-9, the
worst gradient 5.1e-7 for every pattern; packed 2.2e-7, 7.6e-8, 4.9e-7; chunked: loss
7.4e-9, gradients 4.8e-7); a ring that mixed the heads of two TP ranks, or attended
locally, is off by 1e-1, and the chunked loss without the hidden states' gradient summed
over TP by 1.2.

And the negative: the same TP model under a CP state built with ``tp_size=1`` (its CP groups
would be TP groups) is refused by name on every rank, as is a model that is not
tensor-parallel under a ``tp_size=2`` state.
"""

from __future__ import annotations

import pytest
import torch

import tensor_parallel_loading
from distributed import run_world

if not tensor_parallel_loading.AVAILABLE:
    pytest.skip("transformers' DistributedConfig(tp_size, fsdp_size) is 5.x only", allow_module_level=True)

SEQ, VOCAB = 32, 64
TOL = 2e-5


def _save_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(path)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` int64 ``(1, SEQ)`` and their labels shifted on the full row, ``(1, SEQ)``."""
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    shift = torch.full_like(ids, -100)
    shift[:, :-1] = ids[:, 1:]
    return ids, shift


def _reference(path: str) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    ids, shift = _batch()
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten(), reduction="mean")
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters()}


DOCS = (12, 20)  # a packed row's documents, each a multiple of 2 * cp


def _packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row of :data:`DOCS`: ``input_ids``, its positions (from 0 in each document)
    and labels shifted inside each document, int64 ``(1, SEQ)``; ``cu_seqlens`` int32 ``(3,)``."""
    ids, _ = _batch()
    positions = torch.cat([torch.arange(n) for n in DOCS])[None]
    shift = torch.full_like(ids, -100)
    start = 0
    for n in DOCS:
        shift[:, start : start + n - 1] = ids[:, start + 1 : start + n]
        start += n
    cu = torch.tensor([0, DOCS[0], sum(DOCS)], dtype=torch.int32)
    return ids, positions, shift, cu


def _packed_reference(path: str) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """Each document of the packed row alone through one process: logits ``(1, SEQ, VOCAB)``,
    the token-mean loss over the row, the gradients."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    ids, _, shift, cu = _packed_batch()
    logits = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten(), reduction="mean")
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


PATTERNS = ("ring", "allgather", "ulysses", "auto", "ring_packed", "ring_chunked")
# The same with sequence parallelism inside TP (enable_sequence_parallel), run after the above.
# "_ckpt": with gradient checkpointing, which keeps each layer's input: a piece under SP.
SP_PATTERNS = ("ring_sp", "ulysses_sp", "ring_packed_sp", "ring_chunked_sp", "ring_ckpt_sp")


def _tp_cp_case(rank: int, world: int, path: str) -> dict:
    """Per pattern: this rank's relative errors against one process (see the module docstring)."""
    import hf_ring
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.memory.chunked_loss import ChunkedLossConfig, model_token_loss_sum
    from hf_ring.memory.sequence_parallel import enable_sequence_parallel
    from hf_ring.sharding import shard_packed, shard_sequence

    dense_reference = _reference(path)
    model = LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
                                             attn_implementation="ring_flash", dtype=torch.float32)
    results = {}
    for pattern in PATTERNS + SP_PATTERNS:
        state = hf_ring.setup_context_parallel(cp_size=2, tp_size=2, pattern=pattern.split("_")[0])
        if pattern.endswith("_sp"):
            enable_sequence_parallel(model)
        if "_ckpt" in pattern:  # checkpointing runs in training mode only
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        ref_logits, ref_loss, ref_grads = dense_reference
        if "_packed" in pattern:
            ids, positions, shift, cu = _packed_batch()
            ref_logits, ref_loss, ref_grads = _packed_reference(path)
            extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS))

            def shard(t: torch.Tensor) -> torch.Tensor:
                return shard_packed(t, cu, 2, state.cp_rank, dim=1)
        else:
            (ids, shift), positions, extra = _batch(), torch.arange(SEQ)[None], {}

            def shard(t: torch.Tensor) -> torch.Tensor:
                return shard_sequence(t, 2, state.cp_rank, dim=1, layout=state.layout)

        count = (shift != -100).sum()
        model.zero_grad(set_to_none=True)
        inputs = dict(input_ids=shard(ids), position_ids=shard(positions), **extra)
        try:
            if "_chunked" in pattern:  # the loss on each TP rank's vocabulary rows, 5 tokens at a time
                local, out = model_token_loss_sum(model, model, inputs, shard(shift), ChunkedLossConfig(True, 5))
                logits = torch.empty(0)
            else:
                logits = model(**inputs).logits
                local = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard(shift).flatten(),
                                                          reduction="sum")
        except (ValueError, NotImplementedError) as e:
            results[pattern] = f"refused: {e}"
            continue
        (local / count * 2).backward()  # FSDP2 averages over the 2 CP ranks it shards over
        loss = local.detach().clone()
        torch.distributed.all_reduce(loss, group=state.cp_group)
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters()}
        results[pattern] = {
            "cp_ranks": state.cp_ranks,
            "logits": _relative(logits.detach(), shard(ref_logits)) if logits.numel() else 0.0,
            "loss": abs(loss.item() / count.item() - ref_loss) / ref_loss,
            "grads": {n: _relative(g, ref_grads[n]) for n, g in grads.items()},
        }
    results["lora"] = _lora_case(path)
    # 30 tokens in the contiguous layout: 15 on each CP rank, which 2 TP ranks cannot halve.
    state = hf_ring.setup_context_parallel(cp_size=2, tp_size=2, layout="contiguous")
    try:
        odd = dict(input_ids=_batch()[0][:, :30], position_ids=torch.arange(30)[None])
        model(**{k: shard_sequence(v, 2, state.cp_rank, dim=1, layout=state.layout) for k, v in odd.items()})
        results["sp_odd_length"] = "ran"
    except NotImplementedError as e:
        results["sp_odd_length"] = str(e)
    return results


LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # column- and row-parallel layers


def _lora(model, draw: bool = True, seed: int | None = None):
    """``model`` with a rank-4 LoRA on :data:`LORA_TARGETS`, PEFT's own initialisation drawn
    from the global generator (seeded by ``seed`` on every rank alike, or as each rank's own
    is); with ``draw`` every adapter weight then drawn again by :func:`_draw_lora`."""
    from peft import LoraConfig, get_peft_model

    if seed is not None:
        torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS))
    return _draw_lora(model) if draw else model


def _draw_lora(model):
    """Every adapter weight of ``model`` drawn from a generator seeded by its name (``lora_B``
    too, so that the adapters move the output), the whole weight on every rank, each keeping
    its part as the TP adapter's own placement says."""
    import zlib

    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                full = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) / 4
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _peft_sizes_whole_layers() -> bool:
    """Whether the installed PEFT sizes a TP adapter from its base layer's whole widths and
    lets transformers split it (0.22.0 on), not from the local shard of the base weight (0.21)."""
    import peft
    from packaging.version import Version

    return Version(peft.__version__) >= Version("0.22.0")


def _lora_case(path: str) -> dict:
    """A LoRA on the TP model at tp2 x cp2 (ring), prepared as RingTrainer prepares it, against
    the same LoRA on one process: the adapters' gradients, relative to the largest value.

    Loaded with the base replicated over the CP ranks (``dp_replicate_size``), and with it
    sharded over them by FSDP2 (``fsdp_size``): PEFT 0.21 sizes an adapter there from its base
    layer's local FSDP2 shard (refused by name); PEFT 0.22 sizes it from the whole layer and
    transformers splits it, so it must compute what one process computes too, its own
    initialisation drawn on each rank's generator must be refused by the alike check (the
    split ``lora_A`` of the row-parallel layers differ), and drawn on generators seeded alike
    must be the one-process initialisation."""
    import hf_ring
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.sharding import shard_sequence
    from hf_ring.training.adapters import prepare_adapters

    state = hf_ring.setup_context_parallel(cp_size=2, tp_size=2)
    reference = _lora(LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32))
    ids, shift = _batch()
    logits = reference(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten()).backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    load = dict(attn_implementation="ring_flash", dtype=torch.float32)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 2, state.cp_rank, dim=1, layout=state.layout)

    def run(model) -> tuple[float, dict[str, float]]:
        """``model``'s logits and adapter gradients at tp2 x cp2, relative to one process's."""
        local = model(input_ids=shard(ids), position_ids=shard(torch.arange(SEQ)[None])).logits
        loss = torch.nn.functional.cross_entropy(local.flatten(0, 1), shard(shift).flatten(), reduction="sum")
        (loss / (shift != -100).sum() * 2).backward()  # the adapters' gradients are averaged over the 2 CP ranks
        return _relative(local.detach(), shard(logits.detach())), {
            n: _relative(_whole(p.grad), want[n]) for n, p in model.named_parameters() if p.requires_grad}

    def sharded_model():
        return LlamaForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2), **load)

    out = {}
    # PEFT's own initialisation, each rank's generator seeded otherwise (processes launched
    # without a common seed): PEFT 0.21 sizes adapters from the FSDP2 shard, refused by name;
    # PEFT 0.22 sizes them right, and the split ones differ between the CP ranks.
    torch.manual_seed(1000 + torch.distributed.get_rank())
    try:
        prepare_adapters(_lora(sharded_model(), draw=False), state)
        out["sharded"] = "prepared"
    except (NotImplementedError, ValueError) as e:
        out["sharded"] = str(e)
    if _peft_sizes_whole_layers():
        seeded = _lora(sharded_model(), draw=False, seed=7)  # every rank seeded alike
        prepare_adapters(seeded, state)
        plain = dict(_lora(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32), draw=False,
                           seed=7).named_parameters())
        out["sharded_init"] = max((_whole(p.detach()) - plain[n]).abs().max().item()
                                  for n, p in seeded.named_parameters() if p.requires_grad)
        out["sharded_logits"], out["sharded_grads"] = run(_draw_lora(seeded))
    # The base weights replicated over the CP ranks (frozen: no optimizer state to shard).
    model = _lora(LlamaForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=2, dp_replicate_size=2), **load))
    out["averaged"] = prepare_adapters(model, state)
    out["logits"], out["grads"] = run(model)
    # PEFT's default recipes keep lora_dropout > 0: beside TP its draw on a head-split input is refused.
    for module in model.modules():
        if hasattr(module, "lora_dropout"):  # PEFT puts an Identity there for lora_dropout=0
            module.lora_dropout["default"] = torch.nn.Dropout(0.1)
    try:
        model.train()(input_ids=shard(ids), position_ids=shard(torch.arange(SEQ)[None]))
        out["dropout"] = "ran"
    except NotImplementedError as e:
        out["dropout"] = str(e)
    return out


# Hybrid families beside TP: Qwen3.5 (gated delta nets, every projection gathered by its TP
# plan), LFM2 (short convolutions) and Bamba (Mamba-2), whose plans do not name their mixers.
HYBRIDS = ("qwen3_5_text", "lfm2", "bamba")


def _save_hybrid(path: str, family: str) -> None:
    """The sweep's tiny ``family`` model (Qwen3.5's with its two layer kinds twice)."""
    from model_sweep_configs import build_config
    from transformers import AutoModelForCausalLM

    tiny = build_config(family)
    more = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2) \
        if family == "qwen3_5_text" else {}
    config = type(tiny).from_dict({**tiny.to_dict(), "vocab_size": VOCAB, "use_cache": False, **more})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(path)


def _hybrid_reference(path: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process on the full sequence: logits and gradients. In float64 its recurrences are
    hf_ring's one-process ops in float64 (transformers' run in float32 whatever the input:
    the referee of tests/test_hf_hybrid.py)."""
    import importlib

    from test_hf_hybrid import _FLOAT64
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)
    module = importlib.import_module(type(model).__module__)
    swapped = {n: fn for n, fn in _FLOAT64.items() if n in vars(module)} if dtype == torch.float64 else {}
    saved = {name: getattr(module, name) for name in swapped}
    vars(module).update(swapped)
    try:
        ids, shift = _batch()
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten()).backward()
    finally:
        vars(module).update(saved)
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _hybrid_case(rank: int, world: int, path: str) -> dict:
    """Qwen3.5 at tp2 x cp2, float32: this rank's logits of its shard and every full gradient."""
    import hf_ring
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.sharding import shard_sequence

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
                                                 attn_implementation="ring_flash", dtype=torch.float32)
    state = hf_ring.setup_context_parallel(cp_size=2, tp_size=2)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, 2, state.cp_rank, dim=1, layout=state.layout)

    ids, shift = _batch()
    logits = model(input_ids=shard(ids), position_ids=shard(torch.arange(SEQ)[None])).logits
    local = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard(shift).flatten(), reduction="sum")
    (local / (shift != -100).sum() * 2).backward()  # FSDP2 averages over the 2 CP ranks
    return {"cp_rank": state.cp_rank, "logits": logits.detach(),
            "grads": {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                      for n, p in model.named_parameters()}}


def _refusal_case(rank: int, world: int, path: str) -> list[str]:
    import hf_ring
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    from hf_ring.sharding import shard_sequence

    ids, _ = _batch()
    messages = []
    tp_model = LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2),
                                                attn_implementation="ring_flash", dtype=torch.float32)
    plain = LlamaForCausalLM.from_pretrained(path, attn_implementation="ring_flash", dtype=torch.float32)
    for model, tp_size in ((tp_model, 1), (plain, 2)):
        state = hf_ring.setup_context_parallel(cp_size=2, tp_size=tp_size)

        def shard(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, 2, state.cp_rank, dim=1, layout=state.layout)

        try:  # valid inputs: without the check both forwards would run, the first one wrong
            model(input_ids=shard(ids), position_ids=shard(torch.arange(SEQ)[None]))
            messages.append("ran")
        except ValueError as e:
            messages.append(str(e))
    from hf_ring.memory.sequence_parallel import enable_sequence_parallel

    try:
        enable_sequence_parallel(plain)
        messages.append("sequence parallel")
    except ValueError as e:
        messages.append(str(e))
    # RingTrainer's construction check, with the real model and states: the plugin's tp_size must be
    # the model's, and only RingTrainer's own loss has run beside TP.
    from types import SimpleNamespace

    from hf_ring.training.trainer_checks import _check_tensor_parallel

    for tp_size, subclass_loss in ((1, False), (2, True)):
        trainer = SimpleNamespace(ring_state=hf_ring.setup_context_parallel(cp_size=2, tp_size=tp_size),
                                  model=tp_model)
        try:
            _check_tensor_parallel(trainer, subclass_loss)
            messages.append("accepted")
        except (ValueError, NotImplementedError) as e:
            messages.append(str(e))
    return messages


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tp_llama"))
    _save_model(path)
    return path


_RESULTS: dict[str, list[dict]] = {}


def _tp_cp_results(path: str) -> list[dict]:
    """Every rank's results of :func:`_tp_cp_case`, computed once for all the patterns."""
    if path not in _RESULTS:
        _RESULTS[path] = run_world(4, _tp_cp_case, path)
    return _RESULTS[path]


@pytest.mark.parametrize("pattern", PATTERNS + SP_PATTERNS)
def test_tp2_cp2_computes_what_one_process_computes(model_dir, pattern):
    results = _tp_cp_results(model_dir)
    assert isinstance(results[0][pattern], dict), results[0][pattern]
    assert [r[pattern]["cp_ranks"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]  # one TP coordinate each
    for rank, r in enumerate(r[pattern] for r in results):
        assert r["logits"] < TOL, (rank, r["logits"])
        assert r["loss"] < TOL, (rank, r["loss"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < TOL, (rank, worst, r["grads"][worst])
        assert len(r["grads"]) == 21  # every parameter of the 2-layer Llama compared


def test_lora_on_a_tp_model_tp2_cp2_computes_what_one_process_computes(model_dir):
    """PEFT splits each adapter as its base layer is split (lora_B column-wise, lora_A
    row-wise); hf_ring mends their widths and averages their gradients over the CP ranks,
    which transformers' load-time FSDP2 does not hold. Tolerance as above (measured: logits
    2.9e-7, gradients <= 2.4e-6); without the averaging each CP rank keeps its own tokens'
    gradient: off by 0.55 to 3.5. Loaded with fsdp_size=2 instead, PEFT 0.21 sizes the adapters
    from the FSDP2 shards of their base layers: refused by name; PEFT 0.22 sizes them from the
    whole layers: exact as well (measured: logits 2.9e-7, gradients <= 2.1e-6), its own
    initialisation the one-process one when every rank is seeded alike, and refused by name
    when the ranks drew it from generators seeded otherwise. LoRA dropout beside TP is refused."""
    whole = _peft_sizes_whole_layers()
    for rank, r in enumerate(r["lora"] for r in _tp_cp_results(model_dir)):
        if not whole:
            # every lora_B (the output width); the lora_A PEFT happens to size right
            assert "sized 10 LoRA weights from their base layer's local FSDP2 shard" in r["sharded"], r["sharded"]
            assert "dp_replicate_size=<dp x cp>" in r["sharded"]
        else:
            # the split lora_A of o_proj and down_proj in 2 layers (lora_B starts at 0 everywhere)
            assert "4 weights differ between the ranks of the data-parallel x context-parallel group" in r["sharded"], r
            assert "o_proj.lora_A" in r["sharded"] and "seed every process the same way" in r["sharded"]
            assert r["sharded_init"] == 0.0, (rank, r["sharded_init"])
            assert r["sharded_logits"] < TOL, (rank, r["sharded_logits"])
            worst = max(r["sharded_grads"], key=r["sharded_grads"].get)
            assert len(r["sharded_grads"]) == 20 and r["sharded_grads"][worst] < TOL, (rank, worst, r["sharded_grads"])
        assert r["averaged"] == 20 and len(r["grads"]) == 20, r  # 2 layers x 5 targets x (A, B)
        assert "beside tensor parallelism (tp_size=2)" in r["dropout"] and "lora_dropout" in r["dropout"], r["dropout"]
        assert r["logits"] < TOL, (rank, r["logits"])
        worst = max(r["grads"], key=r["grads"].get)
        assert r["grads"][worst] < TOL, (rank, worst, r["grads"][worst])


def test_sequence_parallel_refuses_a_length_tp_cannot_halve(model_dir):
    for r in _tp_cp_results(model_dir):
        assert "sequence of 15 tokens does not divide into 2 equal pieces" in r["sp_odd_length"], r["sp_odd_length"]
        assert "pad_to_multiple_of" in r["sp_odd_length"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_tp2_cp2_computes_what_one_process_computes(tmp_path, family):
    """A hybrid model at tp2 x cp2: its TP plan leaves the token mixers whole (Qwen3.5 gathers
    its delta nets' projections; LFM2's convolutions and Bamba's Mamba-2 are not in their
    plans), so every TP rank runs every head, and hf_ring routes them to its CP ops, whose
    states pass over the CP group of one TP coordinate. Against one process on the full
    sequence, float32, tests/test_hf_hybrid.py's rule: logits and every gradient within 1e-4
    relative, or a gradient (the decay parameters': a few entries, sums that nearly cancel)
    within twice the one-process float32 error of a float64 referee. Measured: logits
    <= 3.8e-7; every gradient within 1e-4 but Qwen3.5's ``A_log`` (1.3e-3 against float32,
    within its float64 referee's bound); LFM2 and Bamba within 5.6e-7."""
    from hf_ring.sharding import shard_sequence

    path = str(tmp_path)
    _save_hybrid(path, family)
    ranks = run_world(4, _hybrid_case, path)
    ref_logits, ref_grads = _hybrid_reference(path, torch.float32)
    _, exact = _hybrid_reference(path, torch.float64)
    for rank, r in enumerate(ranks):
        want = shard_sequence(ref_logits, 2, r["cp_rank"], dim=1)
        assert _relative(r["logits"], want) < 1e-4, (rank, _relative(r["logits"], want))
        assert len(r["grads"]) == len(ref_grads)
        for n, g in r["grads"].items():
            error = _relative(g, ref_grads[n])
            if error > 1e-4:
                single = _relative(ref_grads[n].double(), exact[n])
                assert _relative(g.double(), exact[n]) <= max(1e-4, 2 * single), (rank, n, error, single)


def test_cp_groups_that_cross_tp_coordinates_are_refused(model_dir):
    for rank, (crossed, not_tp, sp_not_tp, plugin, trl) in enumerate(run_world(4, _refusal_case, model_dir)):
        assert "sequence parallelism inside TP: LlamaForCausalLM is not tensor-parallel" in sp_not_tp, sp_not_tp
        assert "is tensor-parallel over ranks" in crossed and "tp_size=1" in crossed, (rank, crossed)
        assert "setup_context_parallel(cp_size=2, tp_size=2)" in crossed, (rank, crossed)
        assert "is not tensor-parallel" in not_tp, (rank, not_tp)
        assert "RingAttentionPlugin(cp_size=2, tp_size=2)" in plugin, (rank, plugin)
        assert "beside tensor parallelism (tp_size=2) has not been checked" in trl, (rank, trl)


def test_auto_offers_hybrid_beside_tp_only_with_its_ulysses_groups_inside_a_node():
    """Beside TP a CP group's ranks are ``tp`` apart (tests/test_nd_cp.py runs hybrid at
    cp4 x tp2): ``auto`` offers hybrid when its Ulysses groups of consecutive CP ranks each
    lie inside a node, read with that stride."""
    from hf_ring.patterns.auto import pattern_candidates

    call = dict(n_heads=8, n_kv_heads=8, seq_len=4096, cp_size=4)
    # CP ranks 0, 2, 4, 6 (TP 2), 4 processes per node: Ulysses over {0, 2} and {4, 6}, the ring across.
    offered = {c.pattern: c.ulysses_size for c in pattern_candidates(**call, local_world_size=4, rank_stride=2)}
    assert offered.get("hybrid") == 2, offered
    # 2 processes per node: every CP rank on a node of its own, so no Ulysses group fits a node.
    assert "hybrid" not in [c.pattern for c in pattern_candidates(**call, local_world_size=2, rank_stride=2)]


def _split_by_override_case(rank: int, world: int, root: str) -> list[str]:
    """Models whose TP plan is overridden at load (``DistributedConfig(tp_plan=...)``, which
    reaches only the top model's plan) so that TP splits a delta net's projection or a vision
    tower's MLP: each forward under tp2 x cp2 must be refused, naming the split module."""
    import hf_ring
    import vlm_cases
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    from hf_ring.sharding import shard_sequence

    state = hf_ring.setup_context_parallel(cp_size=2, tp_size=2)
    messages = []
    hybrid = AutoModelForCausalLM.from_pretrained(
        f"{root}/qwen3_5_text", attn_implementation="ring_flash", dtype=torch.float32,
        distributed_config=DistributedConfig(tp_size=2, fsdp_size=2,
                                             tp_plan={"model.layers.*.linear_attn.in_proj_qkv": "colwise"}))
    ids, _ = _batch()
    image_text = AutoModelForImageTextToText.from_pretrained(
        f"{root}/llava", attn_implementation="ring_flash", dtype=torch.float32,
        distributed_config=DistributedConfig(tp_size=2, fsdp_size=2,
                                             tp_plan={"model.vision_tower.encoder.layers.*.mlp.fc1": "colwise"}))
    for run in (lambda: hybrid(input_ids=shard_sequence(ids, 2, state.cp_rank, dim=1),
                               position_ids=shard_sequence(torch.arange(SEQ)[None], 2, state.cp_rank, dim=1)),
                lambda: image_text(**vlm_cases.FAMILIES["llava"][1](3))):
        try:
            run()
            messages.append("ran")
        except NotImplementedError as e:
            messages.append(str(e))
    from hf_ring.memory.sequence_parallel import enable_sequence_parallel

    for model in (hybrid, image_text):  # what sequence parallelism has not been checked with
        try:
            enable_sequence_parallel(model)
            messages.append("sequence parallel")
        except NotImplementedError as e:
            messages.append(str(e))
    return messages


def test_what_tp_splits_by_a_plan_override_is_refused(tmp_path):
    """The checks read what TP applied (installed forwards, sharded weights), not the model's
    default plan: an override that splits a delta net or a vision tower is refused by name."""
    import vlm_cases

    _save_hybrid(f"{tmp_path}/qwen3_5_text", "qwen3_5_text")
    vlm_cases.build(vlm_cases.FAMILIES["llava"][0](), "sdpa").save_pretrained(f"{tmp_path}/llava")
    for rank, (hybrid, image_text, sp_hybrid, sp_image_text) in enumerate(
            run_world(4, _split_by_override_case, str(tmp_path))):
        assert "layers.0.linear_attn (Qwen3_5GatedDeltaNet) is neither a TP block" in sp_hybrid, (rank, sp_hybrid)
        assert "LlavaForConditionalGeneration's decoder is not its base model" in sp_image_text, (rank, sp_image_text)
        assert "token mixers beside tensor parallelism (tp_size=2): TP splits them (" in hybrid, (rank, hybrid)
        assert "linear_attn.in_proj_qkv: a TP forward that splits it" in hybrid, (rank, hybrid)
        assert "TP splits modules outside its language model (" in image_text, (rank, image_text)
        assert "vision_tower.encoder.layers.0.mlp.fc1: a TP forward that splits it" in image_text, (rank, image_text)


IMAGE_TEXT = ("llava", "qwen2_vl")


def _image_text_case(rank: int, world: int, root: str) -> dict:
    """LLaVA and Qwen2-VL (its vision tower split over the CP group, a video in the second row)
    at tp2 x cp2: this rank's logits of its shard and every gradient (``full_tensor()``),
    against one process on the full batch, the image-text tests' weighted loss."""
    import hf_ring
    import vlm_cases
    import vlm_checks
    from transformers import AutoModelForImageTextToText
    from transformers.distributed import DistributedConfig

    state = hf_ring.setup_context_parallel(cp_size=2, tp_size=2)
    out = {}
    for family in IMAGE_TEXT:
        batch = vlm_cases.FAMILIES[family][1](3)
        weights = torch.randn(vlm_cases.ROWS, vlm_cases.SEQ, vlm_cases.VOCAB, generator=torch.Generator().manual_seed(5))
        reference = vlm_checks.run_full(AutoModelForImageTextToText.from_pretrained(
            f"{root}/{family}", attn_implementation="sdpa", dtype=torch.float32).train(), batch, weights)
        model = AutoModelForImageTextToText.from_pretrained(
            f"{root}/{family}", attn_implementation="ring_flash", dtype=torch.float32,
            distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)).train()
        torch.manual_seed(vlm_checks.FORWARD_SEED)
        logits = model(**batch).logits
        # FSDP2 averages over the 2 CP ranks: each rank's share of the loss, times 2.
        (logits * hf_ring.shard_sequence(weights, 2, state.cp_rank) * 2).sum().backward()
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters() if p.grad is not None}
        errors = {"logits": _relative(logits.detach(), hf_ring.shard_sequence(reference["logits"], 2, state.cp_rank))}
        for n, want in reference["grads"].items():
            if want.norm() < vlm_checks.ZERO:  # zero in exact arithmetic: both sides hold rounding only
                errors[n] = 0.0 if grads[n].norm() < vlm_checks.ZERO else float("inf")
            else:
                errors[n] = ((grads[n] - want).norm() / want.norm()).item()
        out[family] = errors
    return out


def test_image_text_tp2_cp2_computes_what_one_process_computes(tmp_path):
    """The language model TP-split and CP-sharded at its entry, the vision tower whole on every
    rank (Qwen2-VL's split over the CP group): logits (max relative to the largest) and every
    gradient (norm relative) within 1e-4, the image-text tests' tolerance (measured: logits
    <= 3.1e-7, gradients <= 1.0e-6)."""
    import vlm_cases

    for family in IMAGE_TEXT:
        vlm_cases.build(vlm_cases.FAMILIES[family][0](), "sdpa").save_pretrained(f"{tmp_path}/{family}")
    for rank, result in enumerate(run_world(4, _image_text_case, str(tmp_path))):
        for family, errors in result.items():
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-4, (rank, family, worst, errors[worst])
            assert len(errors) > 40  # every parameter of the tower, projector and language model


def test_per_rank_token_means_with_several_data_parallel_ranks_are_refused():
    """RingTrainer's loss is the stock one under average_tokens_across_devices=True; False with
    dp > 1 makes the stock loss a mean of per-rank means: refused by name, accepted at dp 1."""
    from types import SimpleNamespace

    from hf_ring.training.trainer_checks import _check_token_averaging

    with pytest.raises(NotImplementedError, match="average_tokens_across_devices=False with several"):
        _check_token_averaging(SimpleNamespace(average_tokens_across_devices=False), 2)
    _check_token_averaging(SimpleNamespace(average_tokens_across_devices=False), 1)
    _check_token_averaging(SimpleNamespace(average_tokens_across_devices=True), 4)


def test_pipeline_parallel_configs_are_refused_for_training():
    """transformers' pipeline parallelism runs forward only: a Ring trainer refuses it by name
    (read from the model's ``config.distributed_config``), and accepts a config without it,
    with ``enable_sequence_parallel`` (hf_ring's, tested above) or without."""
    from types import SimpleNamespace

    from hf_ring.training.trainer_checks import _check_distributed_config

    def model(**sizes):
        return SimpleNamespace(config=SimpleNamespace(distributed_config=SimpleNamespace(**sizes)))

    with pytest.raises(NotImplementedError, match=r"pp_size=2\): transformers' pipeline parallelism is inference-only"):
        _check_distributed_config(model(pp_size=2, enable_sequence_parallel=False))
    _check_distributed_config(model(pp_size=1, enable_sequence_parallel=True))
    _check_distributed_config(model(pp_size=1, enable_sequence_parallel=False))
    _check_distributed_config(SimpleNamespace(config=SimpleNamespace()))
