"""The long-context memory options compute exactly what the plain model computes.

- the chunked LM head + cross-entropy against ``token_loss_sum`` over the full logits: loss
  and the gradients of the hidden states, the head's weight and bias; float32 and float64,
  label masks, chunk sizes that do not divide the tokens, the head transforms of Gemma 2,
  Cohere and Granite, tied embeddings; a forward it cannot reproduce is refused;
- activation checkpointing offloaded to host memory, and the tiled MLP, against the plain
  model (loss and every parameter's gradient); MoE MLPs refused;
- one real 2-process CP run of the example with all three on against the same run with
  all off: training loss, gradient norm and eval loss at every step.

Tolerances: the loss is float32 (as ``token_loss_sum``'s), summed over chunks in another
order than one reduction over all rows: a few ulps, so 1e-6 relative. A gradient is compared
on its own scale: ``max |got - ref| <= tol * max |ref|`` with tol 1e-6 in float32 and 1e-12 in
float64; the matmuls run on row blocks of another size (another summation order inside
BLAS) and the weight gradient is a sum of per-chunk products, so elements that cancel
differ by a few ulps of the largest term (measured: at most 6e-7 of the scale in float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hf_ring  # noqa: F401  (registers ring_flash, patches transformers)
from hf_ring.memory.chunked_loss import ChunkedLossConfig, LogitTransform, chunked_token_loss_sum, model_token_loss_sum
from hf_ring.training.loss import token_loss_sum
from hf_ring.memory.offload import enable_offloaded_checkpointing
from hf_ring.memory.tiled_mlp import tile_mlps

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _assert_close_on_scale(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, what
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"{what}: max |difference| {err:.3g} > {tol:g} x max |reference| {scale:.3g}"


def _assert_loss_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item()), (got.item(), ref.item())


def _labels(shape: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.4] = -100  # scattered masks
    labels[..., :5] = -100  # a masked prompt
    return labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform("softcap", 2.5),
                                       LogitTransform("scale", 0.3), LogitTransform("divide", 4.0)])
def test_chunked_loss_equals_the_full_computation(dtype, transform):
    torch.manual_seed(0)
    vocab, hidden_size = 301, 24
    hidden = torch.randn(2, 37, hidden_size, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=dtype, requires_grad=True)
    bias = torch.randn(vocab, dtype=dtype, requires_grad=True)
    labels = _labels((2, 37), vocab, seed=1)
    full = token_loss_sum(transform(F.linear(hidden, weight, bias)), labels)
    ref_grads = torch.autograd.grad(full, (hidden, weight, bias))
    for chunk in (1, 7, 32, 1000):  # 7 and 32 do not divide the valid rows
        got = chunked_token_loss_sum(hidden, labels, weight, bias, chunk_tokens=chunk, transform=transform)
        _assert_loss_close(got, full)
        for name, g, r in zip(("hidden", "weight", "bias"), torch.autograd.grad(got, (hidden, weight, bias)), ref_grads):
            _assert_close_on_scale(g, r, TOL[dtype], f"chunk {chunk}: grad of {name}")


def test_chunked_loss_without_a_valid_label_is_zero_with_zero_gradients():
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    weight = torch.randn(11, 4, requires_grad=True)
    labels = torch.full((1, 8), -100)
    loss = chunked_token_loss_sum(hidden, labels, weight, chunk_tokens=3)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="shift_labels"):
        chunked_token_loss_sum(hidden, labels[:, :4], weight, chunk_tokens=3)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkedLossConfig(chunk_tokens=0)


def _tiny(family: str, **extra):
    import transformers

    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    config = config_cls(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False, **extra)
    torch.manual_seed(0)
    return model_cls(config).double().train()


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, ref, tol):
    _assert_loss_close(got[0], ref[0])
    assert sorted(got[1]) == sorted(ref[1])
    for name in ref[1]:
        _assert_close_on_scale(got[1][name], ref[1][name], tol, name)


@pytest.mark.parametrize("family,extra,kind", [
    ("Llama", {"tie_word_embeddings": True}, "identity"),
    ("Llama", {"tie_word_embeddings": False}, "identity"),
    ("Gemma2", {"final_logit_softcapping": 3.0}, "softcap"),
    ("Cohere", {"logit_scale": 0.5}, "scale"),
    ("Granite", {"logits_scaling": 4.0}, "divide"),
])
def test_chunked_loss_through_the_model(family, extra, kind):
    model = _tiny(family, **extra)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(2))
    labels = _labels((2, 19), 97, seed=3)
    ref = _loss_and_grads(model, lambda m: token_loss_sum(m(input_ids=ids).logits, labels))
    outputs = {}

    def chunked(m):
        loss, outputs["out"] = model_token_loss_sum(m, m, {"input_ids": ids}, labels, ChunkedLossConfig(True, 5))
        return loss

    got = _loss_and_grads(model, chunked)
    assert LogitTransform.of_model(model, "lm_head").kind == kind
    assert outputs["out"].logits.shape == (2, 19, 0)  # the head never ran
    assert "forward" not in vars(model.lm_head)  # and is itself again
    _assert_same(got, ref, TOL[torch.float64])


def test_chunked_loss_on_packed_rows():
    """A packed row (three documents, ring_flash's varlen path) with its prompt masked."""
    model = _tiny("Llama")
    model.set_attn_implementation("ring_flash")
    doc_lens = [6, 10, 4]
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(6))
    cu = torch.tensor([0, 6, 16, 20], dtype=torch.int32)
    kwargs = dict(input_ids=ids, position_ids=torch.cat([torch.arange(n) for n in doc_lens])[None],
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10)
    labels = _labels((1, 20), 97, seed=7)
    labels[0, [5, 15, 19]] = -100  # no label across a document boundary
    ref = _loss_and_grads(model, lambda m: token_loss_sum(m(**kwargs).logits, labels))
    got = _loss_and_grads(
        model, lambda m: model_token_loss_sum(m, m, kwargs, labels, ChunkedLossConfig(True, 3))[0])
    _assert_same(got, ref, TOL[torch.float64])


def test_chunked_loss_refuses_an_unknown_head_transform():
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class ScaledHead(LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden_states) * 2.0
            return CausalLMOutputWithPast(logits=logits)

    model = ScaledHead(_tiny("Llama").config)
    labels = _labels((1, 8), 97, seed=0)
    with pytest.raises(NotImplementedError, match=r"self\.lm_head\(hidden_states\) \* 2\.0.*chunked_loss=False"):
        model_token_loss_sum(model, model, {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, labels,
                             ChunkedLossConfig(True))


def test_offloaded_checkpoints_and_tiled_mlp_are_exact():
    model = _tiny("Llama")
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(4))
    labels = _labels((2, 23), 97, seed=5)
    loss = lambda m: token_loss_sum(m(input_ids=ids).logits, labels)  # noqa: E731
    ref = _loss_and_grads(model, loss)

    offloaded, stats = copy.deepcopy(model), {}
    enable_offloaded_checkpointing(offloaded, stats)
    _assert_same(_loss_and_grads(offloaded, loss), ref, TOL[torch.float64])
    # Exactly the layers' checkpointed inputs went to the host: layers x tokens x hidden.
    assert stats["peak_bytes"] == 2 * ids.numel() * 32 * 8 and stats["bytes"] == 0

    tiled = copy.deepcopy(model)
    calls = []
    tiled.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: calls.append(a[1][0].shape[-2]))
    assert tile_mlps(tiled, 7) == 2
    got = _loss_and_grads(tiled, loss)
    _assert_same(got, ref, TOL[torch.float64])
    assert calls[:4] == [7, 7, 7, 2]  # the forward ran in tiles of 7 tokens (then the recompute)

    both = copy.deepcopy(model)
    enable_offloaded_checkpointing(both)
    tile_mlps(both, 5)
    _assert_same(_loss_and_grads(both, loss), ref, TOL[torch.float64])


def test_tiling_again_applies_the_new_tile_size():
    """A second ``tile_mlps`` with another size tiles by that size (it used to keep the first
    one without a word), exact as above against the plain model in float64."""
    model = _tiny("Llama")
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(4))
    labels = _labels((2, 23), 97, seed=5)
    loss = lambda m: token_loss_sum(m(input_ids=ids).logits, labels)  # noqa: E731
    ref = _loss_and_grads(model, loss)

    tiled = copy.deepcopy(model)
    calls = []
    tiled.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: calls.append(a[1][0].shape[-2]))
    assert tile_mlps(tiled, 7) == 2
    assert tile_mlps(tiled, 4) == 2
    _assert_same(_loss_and_grads(tiled, loss), ref, TOL[torch.float64])
    # The forward ran 23 tokens in tiles of 4, and nothing (forward or recompute) in tiles of 7.
    assert calls[:6] == [4, 4, 4, 4, 4, 3] and set(calls) == {4, 3}, calls


def test_tiled_mlp_refuses_mixture_of_experts():
    import transformers

    config = transformers.MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    model = transformers.MixtralForCausalLM(config)
    # transformers 5 names Mixtral's experts block `mlp` (refused as a mixture of experts);
    # 4.57 names it `block_sparse_moe`, so no layer has an MLP to tile.
    with pytest.raises(NotImplementedError,
                       match="(mixture of experts|no decoder layers with an 'mlp' module).*drop the tiled-MLP option"):
        tile_mlps(model, 8)


def test_cp2_training_with_every_option_matches_without(tmp_path):
    """cp_size 2, real processes: chunked loss (chunks of 5 tokens, a 1000-token vocabulary),
    offloaded checkpoints and a tiled MLP against the same run with none of them."""
    from test_trainer_cp import _eval_losses, _grad_norms, _launch, _losses

    def same_per_step(got: dict, ref: dict, what: str) -> None:
        # float32 sums in another order (~1e-7 relative, as measured) carried through 4 AdamW steps.
        assert sorted(got) == sorted(ref) and ref, (what, got, ref)
        for step, value in ref.items():
            assert abs(got[step] - value) <= 1e-5 * abs(value), f"{what} at step {step}: {got[step]} vs {value}"

    common = ["--cp_size", "2", "--per_device_train_batch_size", "2", "--vocab_size", "1000", "--max_steps", "4",
              "--eval_steps", "2", "--num_eval_examples", "4"]
    ref = _launch(2, str(tmp_path / "off"), [*common, "--chunked_loss", "off"])
    got = _launch(2, str(tmp_path / "on"), [*common, "--chunked_loss", "on", "--loss_chunk_tokens", "5",
                                            "--offload_checkpoints", "--tiled_mlp", "24"])
    assert len(_losses(ref)) == 4 and len(_eval_losses(ref)) >= 2
    same_per_step(_losses(got), _losses(ref), "training loss")
    same_per_step(_grad_norms(got), _grad_norms(ref), "gradient norm")
    same_per_step(_eval_losses(got), _eval_losses(ref), "eval loss")


def test_offloading_survives_the_trainer_enabling_checkpointing(tmp_path):
    """``Trainer.train`` with ``gradient_checkpointing=True`` (TRL's default) calls the model's
    ``activation_checkpointing_enable`` again, which installed the plain checkpoint function
    over the offloading one: every checkpointed layer input must still go to the host
    (exactly layers x tokens x hidden float32 bytes at the peak of one step's forward)."""
    from transformers import TrainingArguments

    model = _tiny("Llama").float()
    stats: dict[str, int] = {}
    enable_offloaded_checkpointing(model, stats)
    rows = [{"input_ids": list(range(3, 19))} for _ in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                             per_device_train_batch_size=2, gradient_checkpointing=True, save_strategy="no")
    trainer = hf_ring.RingTrainer(model=model, args=args, train_dataset=rows,
                                  data_collator=hf_ring.RingDataCollator(0))
    trainer.train()
    assert stats.get("peak_bytes") == 2 * 2 * 16 * 32 * 4, stats  # 2 layers x 2 rows x 16 tokens x hidden 32
