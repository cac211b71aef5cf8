"""attn_implementation="ring_flash" in one process (no context parallelism) against "sdpa".

Without CP ring_flash is exact local attention: it runs transformers' own SDPA function
with the mask SDPA gets, so logits must match "sdpa" within 1e-5 relative error (norm of
the difference over norm of the reference; float32, in practice 0) and greedy generation
must give the same tokens. Packed rows go through the ring's varlen path on one rank and
must match each document run on its own within 1e-5. Also: the features ring_flash
refuses, and the transformers patch (other implementations unchanged, unknown versions
refused). Tiny random models: hidden 64, 2 layers, 4 heads over 2 KV heads, vocab 128.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

import hf_ring
import hf_ring.hf.attention
from hf_ring.patches import transformers as tf_patches
from closeness import rel_err
from subprocess_limits import HANG_GUARD_S

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TRANSFORMERS_5 = Version(transformers.__version__) >= Version("5.0.0.dev0")
VOCAB = 128
TOL = 1e-5

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

FAMILIES = ("llama", "qwen2", "mistral")


def tiny_config(family: str, **overrides):
    """A tiny random config of ``family`` (GQA: 4 query heads over 2 KV heads)."""
    kwargs = {**_COMMON, **overrides}
    if family == "llama":
        return LlamaConfig(**kwargs)
    if family == "qwen2":
        return Qwen2Config(**kwargs)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": 4096, **kwargs})
    if family == "gemma2":
        return Gemma2Config(**{"head_dim": 16, "attn_logit_softcapping": 50.0, **kwargs})
    raise ValueError(family)


def tiny_model(config, attn_implementation: str, state_dict=None, seed: int = 0):
    """A float32 model of ``config`` in eval mode; weights from ``state_dict`` or ``seed``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.float().eval()


def sharpen_attention(model, factor: float = 6.0):
    """Scale every layer's q and k projections by ``factor``: a tiny random model's scores
    are so small that softcapping (tanh) would barely change them."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    return model


def _pair(family: str, **overrides):
    config = tiny_config(family, **overrides)
    ring = tiny_model(config, "ring_flash")
    sdpa = tiny_model(config, "sdpa", ring.state_dict())
    assert ring.config._attn_implementation == "ring_flash"
    assert sdpa.config._attn_implementation == "sdpa"
    return ring, sdpa


def _ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


@pytest.fixture(autouse=True)
def _no_cp_state():
    hf_ring.set_context_parallel_state(None)
    yield
    hf_ring.set_context_parallel_state(None)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_sdpa_with_and_without_padding(family):
    ring, sdpa = _pair(family)
    ids = _ids(3, 14)
    right = torch.ones_like(ids)
    right[0, 10:] = 0
    left = torch.ones_like(ids)
    left[1, :5] = 0
    with torch.no_grad():
        for mask in (None, right, left):
            err = rel_err(ring(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits)
            assert err <= TOL, (family, None if mask is None else mask.tolist(), err)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_matches_sdpa(family):
    ring, sdpa = _pair(family)
    ids = _ids(2, 9, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as generation pads
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    out_ring = ring.generate(ids, **kwargs)
    out_sdpa = sdpa.generate(ids, **kwargs)
    assert out_ring.shape[1] == ids.shape[1] + 6
    assert torch.equal(out_ring, out_sdpa)


def test_sliding_window_without_cp_matches_sdpa():
    # Without CP a window shorter than the sequence is computed exactly (SDPA's mask).
    ring, sdpa = _pair("mistral", sliding_window=4)
    ids = _ids(2, 12, seed=3)
    with torch.no_grad():
        assert rel_err(ring(ids).logits, sdpa(ids).logits) <= TOL


def _packed_batch(doc_lens):
    ids = _ids(1, sum(doc_lens), seed=4)
    cu = torch.tensor([0] + list(torch.tensor(doc_lens).cumsum(0)), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in doc_lens])[None]
    return ids, cu, positions


def test_packed_rows_match_each_document_alone(monkeypatch):
    ring, sdpa = _pair("llama")
    calls = []
    ring_op = hf_ring.hf.attention.run_plan
    # Every layer runs the varlen ring on the forward's plan, whose documents are the row's.
    monkeypatch.setattr(
        hf_ring.hf.attention, "run_plan", lambda q, k, v, plan, sinks=None: calls.append(plan.local_doc_lens) or ring_op(q, k, v, plan, sinks)
    )
    doc_lens = [6, 10, 4]
    ids, cu, positions = _packed_batch(doc_lens)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(doc_lens), max_length_k=max(doc_lens))
    with torch.no_grad():
        logits = ring(ids, position_ids=positions, **packed).logits
        reference = torch.cat(
            [sdpa(ids[:, int(a) : int(b)]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1
        )
    assert calls == [tuple(doc_lens)] * ring.config.num_hidden_layers  # the varlen ring, not SDPA's packed mask
    assert rel_err(logits, reference) <= TOL


def test_packed_rows_under_bf16_autocast():
    # Autocast hands the attention q/k in float32 and v in bfloat16; ring_flash computes in
    # bfloat16 like SDPA does. Tolerance: twice the error that SDPA under the same autocast
    # makes against the float32 model (the ring must not be worse than what a user gets
    # without it); each document alone is the reference, as above.
    ring, sdpa = _pair("llama")
    doc_lens = [6, 10, 4]
    ids, cu, positions = _packed_batch(doc_lens)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(doc_lens), max_length_k=max(doc_lens))
    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    with torch.no_grad():
        reference = torch.cat([sdpa(ids[:, a:b]).logits for a, b in docs], dim=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ring(ids, position_ids=positions, **packed).logits
            sdpa_bf16 = torch.cat([sdpa(ids[:, a:b]).logits for a, b in docs], dim=1)
    assert rel_err(logits, reference) <= 2 * rel_err(sdpa_bf16, reference)


def test_packed_rows_refuse_batches_and_padding_masks():
    ring, _ = _pair("llama")
    ids, cu, positions = _packed_batch([6, 10])
    with pytest.raises(ValueError, match="batch size 1"):
        ring(ids.expand(2, -1), position_ids=positions.expand(2, -1), cu_seq_lens_q=cu)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="take no padding attention_mask"):
        ring(ids, attention_mask=mask, position_ids=positions, cu_seq_lens_q=cu)


def test_softcapping_without_cp_matches_eager():
    # Gemma 2: softcap on every layer and a 4-token window on its sliding layers, with a
    # right-padded row; transformers runs it eagerly, ring_flash writes the same math out
    # (local_eager.py). float32 in another order: 1e-5 (measured ~1e-7). Sharpened scores
    # and softcap 1 make the capping matter: dropping it moves the logits by ~2e-2.
    config = tiny_config("gemma2", sliding_window=4, attn_logit_softcapping=1.0)
    ring = sharpen_attention(tiny_model(config, "ring_flash").train())
    eager = tiny_model(config, "eager", ring.state_dict()).train()
    ids = _ids(2, 12)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    got, want = ring(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    assert rel_err(got, want) <= 1e-5
    got.sum().backward()
    want.sum().backward()
    for (name, a), (_, b) in zip(ring.named_parameters(), eager.named_parameters()):
        assert rel_err(a.grad, b.grad) <= 1e-5, name


def test_softcapping_on_packed_rows_is_refused():
    model = tiny_model(tiny_config("gemma2"), "ring_flash")
    ids, cu, positions = _packed_batch([6, 10])
    with pytest.raises(NotImplementedError, match="softcapping.*packed rows"):
        model(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_attention_dropout_in_training_runs_as_sdpa_without_the_ring_and_is_refused_on_it():
    """Without CP on dense rows ring_flash is transformers' SDPA, dropout included: from one
    seed, the same logits as "sdpa". Where the ring runs (packed rows here; under CP in
    test_dropout_under_cp) it is refused by name."""
    ring, sdpa = _pair("llama", attention_dropout=0.5)
    ring.train()
    sdpa.train()
    ids = _ids(2, 8)
    torch.manual_seed(3)
    got = ring(ids).logits
    torch.manual_seed(3)
    want = sdpa(ids).logits
    torch.manual_seed(4)
    other = sdpa(ids).logits
    assert torch.equal(got, want) and not torch.equal(want, other)  # the same draw, and a draw at all
    ids, cu, positions = _packed_batch([6, 10])
    with pytest.raises(NotImplementedError, match="attention dropout 0.5"):
        ring(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_from_pretrained_loads_ring_flash(tmp_path):
    _, sdpa = _pair("qwen2")
    sdpa.save_pretrained(tmp_path)
    ring = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="ring_flash").float().eval()
    assert ring.config._attn_implementation == "ring_flash"
    assert ring.model.__dict__.get("_hf_ring_guarded_model")
    ids = _ids(2, 10, seed=5)
    with torch.no_grad():
        assert rel_err(ring(ids).logits, sdpa(ids).logits) <= TOL


def test_models_asking_for_ring_flash_are_guarded():
    ring, sdpa = _pair("llama")
    assert ring.model.__dict__.get("_hf_ring_guarded_model")
    assert not sdpa.model.__dict__.get("_hf_ring_guarded_model")
    assert copy.deepcopy(ring).model.__dict__.get("_hf_ring_guarded_model")
    sdpa.set_attn_implementation("ring_flash")
    assert sdpa.config._attn_implementation == "ring_flash"
    assert sdpa.model.__dict__.get("_hf_ring_guarded_model")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_other_implementations_load_as_before(implementation):
    model = tiny_model(tiny_config("llama"), implementation)
    assert model.config._attn_implementation == implementation
    with torch.no_grad():
        assert torch.isfinite(model(_ids(1, 6)).logits).all()


def test_unknown_flash_names_fail_as_upstream():
    with pytest.raises(ValueError, match="not supported"):
        tiny_model(tiny_config("llama"), "no_such_flash_impl")
    # A registered name containing "flash" is a Hub flash kernel to transformers 5 (and
    # must stay one); transformers 4.57 compares names exactly and loads it.
    AttentionInterface.register("other_flash", AttentionInterface._global_mapping["sdpa"])
    try:
        if TRANSFORMERS_5:
            with pytest.raises(ValueError, match="Could not find the currently requested flash attention"):
                tiny_model(tiny_config("llama"), "other_flash")
        else:
            assert tiny_model(tiny_config("llama"), "other_flash").config._attn_implementation == "other_flash"
    finally:
        del AttentionInterface._global_mapping["other_flash"]


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.57 has no is_flash_attention_requested")
def test_flash_name_check_unchanged_except_for_ring_flash():
    from transformers.utils.generic import is_flash_attention_requested as patched

    original = patched.original
    for name in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2", "sdpa", "eager", None):
        assert patched(requested_attention_implementation=name) == original(requested_attention_implementation=name)
        assert patched(requested_attention_implementation=name, version=2) == original(
            requested_attention_implementation=name, version=2
        )
    assert original(requested_attention_implementation="ring_flash") is True
    assert patched(requested_attention_implementation="ring_flash") is False
    config = tiny_config("llama")
    config._attn_implementation = "ring_flash"
    assert patched(config) is False
    with pytest.raises(ValueError, match="ambiguous"):
        patched(config, "ring_flash")


@pytest.mark.parametrize("version", ["4.56.2", "4.58.0", "3.0.0", "6.0.0", "6.1.0rc0"])
def test_patch_refuses_versions_it_was_not_written_for(version):
    with pytest.raises(tf_patches.UnsupportedTransformersVersion, match=f"transformers {version}"):
        tf_patches.apply(not_flash={"ring_flash"}, model_hook=lambda model: None, version=version)


def test_patch_knows_its_release_lines():
    assert tf_patches.release_line("4.57.6") == "4.57"
    assert tf_patches.release_line("4.57.0") == "4.57"
    assert tf_patches.release_line("5.24.0") == "5"
    assert tf_patches.release_line("5.0.0rc1") == "5"
    # Every release line the patches accept was written against a real release of it, and
    # the refusal names those releases.
    assert sorted(tf_patches.release_line(v) for v in tf_patches.WRITTEN_FOR) == ["4.57", "5"]
    with pytest.raises(tf_patches.UnsupportedTransformersVersion) as error:
        tf_patches.release_line("4.56.2")
    assert all(v in str(error.value) for v in tf_patches.WRITTEN_FOR), error.value


def test_core_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None; import hf_ring; "
        "print(hf_ring.ring_flash_attn_func.__name__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ring_flash_attn_func"
