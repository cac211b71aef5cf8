"""``hf_ring.patches``: the accessors of private upstream internals, in one process on CPU.

Each is checked three ways: it refuses a version it was not written for (a faked
``__version__``), it refuses an object without the shape it was written for (a fake
Accelerator or Trainer), and it does its job on the real, installed upstream object.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version
from torch.utils.data import DataLoader

from hf_ring.patches import accelerate as acc_patches
from hf_ring.patches import versions
from hf_ring.patches import torch as torch_patches
from hf_ring.patches import transformers as tf_patches

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)


@pytest.fixture
def fresh_process_state():
    """Leave no Accelerate state behind for other tests."""
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


class _AcceleratorWithoutLoaderList:
    """Accelerator.prepare_data_loader's signature, without the ``_dataloaders`` list."""

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        return data_loader


class _AcceleratorWithOtherSignature:
    def __init__(self) -> None:
        self._dataloaders: list = []

    def prepare_data_loader(self, data_loader, device_placement=None):
        return data_loader


# ---- accelerate: versions ----


# Every release whose source was read (patches/accelerate.py's docstring), then newer ones of the line.
_READ = ("1.10.0", "1.10.1", "1.11.0", "1.12.0", "1.13.0", "1.14.0", "1.15.0", "1.16.0")


@pytest.mark.parametrize("version", _READ + ("1.16.1", "1.17.0.dev0", "1.17.0", "1.40.2"))
def test_accelerate_versions_of_its_line_are_accepted(version):
    # Past 1.16.0 with one warning (tests/test_versions.py); the shape checks below still apply.
    assert acc_patches.check_version(version) == version


@pytest.mark.parametrize("version", ["0.34.2", "1.9.0", "1.10.0rc1", "2.0.0.dev0", "2.0.0"])
def test_accelerate_versions_outside_its_range_are_refused(version):
    with pytest.raises(acc_patches.UnsupportedAccelerateVersion) as error:
        acc_patches.check_version(version)
    message = str(error.value)
    assert f"accelerate {version}" in message
    assert f"tested {versions.TESTED['accelerate'].tested_text()}" in message, message
    assert 'pip install "accelerate>=1.10.0,<2"' in message


def test_every_accelerate_function_refuses_an_installed_version_it_does_not_know(monkeypatch):
    import accelerate

    monkeypatch.setattr(accelerate, "__version__", "2.0.0")
    loader = DataLoader(range(4))
    fake = _AcceleratorWithOtherSignature()
    calls = [
        lambda: acc_patches.check_version(),
        lambda: acc_patches.is_prepared(loader),
        lambda: acc_patches.register_data_loader(fake, loader),
        lambda: acc_patches.install_prepare_data_loader(fake, lambda *a: a[0]),
        lambda: acc_patches.prepare_data_loader(fake, loader, num_processes=1, process_index=0),
    ]
    for call in calls:
        with pytest.raises(acc_patches.UnsupportedAccelerateVersion, match="accelerate 2.0.0"):
            call()


# ---- accelerate: shapes ----


def test_accelerator_without_a_loader_list_is_refused():
    fake = _AcceleratorWithoutLoaderList()
    with pytest.raises(acc_patches.UnsupportedAccelerateVersion, match="_dataloaders is NoneType"):
        acc_patches.install_prepare_data_loader(fake, lambda *a: a[0])
    with pytest.raises(acc_patches.UnsupportedAccelerateVersion, match="_dataloaders is NoneType"):
        acc_patches.register_data_loader(fake, DataLoader(range(4)))
    assert "prepare_data_loader" not in vars(fake)


def test_accelerator_whose_prepare_data_loader_has_other_parameters_is_refused():
    fake = _AcceleratorWithOtherSignature()
    with pytest.raises(acc_patches.UnsupportedAccelerateVersion, match="parameters"):
        acc_patches.install_prepare_data_loader(fake, lambda *a: a[0])
    assert "prepare_data_loader" not in vars(fake)


def test_prepared_flag_that_is_not_a_bool_is_refused():
    loader = DataLoader(range(4))
    assert acc_patches.is_prepared(loader) is False
    loader._is_accelerate_prepared = "yes"
    with pytest.raises(acc_patches.UnsupportedAccelerateVersion, match="not a bool"):
        acc_patches.is_prepared(loader)


# ---- accelerate: the real Accelerator ----


def test_installed_preparation_serves_accelerator_prepare(fresh_process_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    calls = []

    def as_rank_1_of_2(data_loader, device_placement, slice_fn_for_dispatch):
        calls.append(data_loader)
        return acc_patches.prepare_data_loader(
            accelerator,
            data_loader,
            num_processes=2,
            process_index=1,
            device_placement=device_placement,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
        )

    acc_patches.install_prepare_data_loader(accelerator, as_rank_1_of_2)
    loader = DataLoader(torch.arange(8), batch_size=1)
    prepared = accelerator.prepare(loader)

    assert calls == [loader]
    # One process stands in for rank 1 of 2: it gets every other batch, starting at the second.
    assert [batch.tolist() for batch in prepared] == [[1], [3], [5], [7]]
    # prepare() flags only what is registered with the Accelerator.
    assert acc_patches.is_prepared(prepared)
    assert not acc_patches.is_prepared(loader)
    assert accelerator.prepare(prepared) is prepared
    assert calls == [loader, prepared]


def test_register_data_loader_is_idempotent(fresh_process_state):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = DataLoader(range(4))
    acc_patches.register_data_loader(accelerator, loader)
    acc_patches.register_data_loader(accelerator, loader)
    # The test of the patch may look at what the patch touches.
    assert accelerator._dataloaders == [loader]


# ---- transformers accessors ----


class _TrainerWithOtherPrepareInputs:
    def __init__(self) -> None:
        self._train_batch_size = True

    def _prepare_inputs(self, inputs, device):
        return inputs


class _ConfigWithPlainAttribute:
    _attn_implementation = "sdpa"


def test_transformers_accessors_refuse_an_installed_version_they_do_not_know(monkeypatch):
    import transformers
    from transformers import LlamaConfig

    config = LlamaConfig(attn_implementation="sdpa")
    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    calls = [
        lambda: tf_patches.attn_implementation(config),
        lambda: tf_patches.train_batch_size(_TrainerWithOtherPrepareInputs()),
        lambda: tf_patches.prepare_inputs(_TrainerWithOtherPrepareInputs(), {}),
    ]
    for call in calls:
        with pytest.raises(tf_patches.UnsupportedTransformersVersion, match="transformers 4.56.2"):
            call()


def test_attn_implementation_reads_the_config():
    from transformers import LlamaConfig

    assert tf_patches.attn_implementation(LlamaConfig(attn_implementation="sdpa")) == "sdpa"
    assert tf_patches.attn_implementation(LlamaConfig(attn_implementation="ring_flash")) == "ring_flash"
    assert tf_patches.attn_implementation(LlamaConfig()) is None
    with pytest.raises(tf_patches.UnsupportedTransformersVersion, match="not a property"):
        tf_patches.attn_implementation(_ConfigWithPlainAttribute())


def test_trainer_accessors_refuse_a_trainer_of_another_shape():
    trainer = _TrainerWithOtherPrepareInputs()
    with pytest.raises(tf_patches.UnsupportedTransformersVersion, match="not an int"):
        tf_patches.train_batch_size(trainer)
    with pytest.raises(tf_patches.UnsupportedTransformersVersion, match=r"\['self', 'inputs', 'device'\]"):
        tf_patches.prepare_inputs(trainer, {})


def test_trainer_accessors_on_a_real_trainer(tmp_path, fresh_process_state):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             per_device_train_batch_size=3)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args)
    assert tf_patches.train_batch_size(trainer) == 3
    inputs = tf_patches.prepare_inputs(trainer, {"input_ids": torch.tensor([[1, 2, 3]])})
    assert inputs["input_ids"].tolist() == [[1, 2, 3]]
    assert inputs["input_ids"].device == args.device


# ---- transformers: what is read from the modeling code ----


class _PassesWindow:
    def forward(self, x):
        return dict(sliding_window=x)


class _ComparesWindow:
    def forward(self, x):
        return self.sliding_window == x


# A builtin has no Python source to read.
_SourceLess = type("_SourceLess", (), {"forward": max})


def test_modeling_readers_refuse_an_installed_version_they_do_not_know(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.56.2")
    calls = [
        lambda: tf_patches.forward_passes_keyword(_PassesWindow, "sliding_window"),
        lambda: tf_patches.attention_class_tables(_PassesWindow),
        lambda: tf_patches.uses_attention_interface(_PassesWindow),
        lambda: tf_patches.forward_reads_keywords(_PassesWindow),
    ]
    for call in calls:
        with pytest.raises(tf_patches.UnsupportedTransformersVersion, match="transformers 4.56.2"):
            call()


def test_forward_passes_keyword_reads_the_call_not_a_comparison():
    assert tf_patches.forward_passes_keyword(_PassesWindow, "sliding_window")
    assert not tf_patches.forward_passes_keyword(_PassesWindow, "window")
    assert not tf_patches.forward_passes_keyword(_ComparesWindow, "sliding_window")
    # Source that cannot be read does not pass: the caller refuses rather than guess.
    assert not tf_patches.forward_passes_keyword(_SourceLess, "sliding_window")


class _ReadsKeywords(torch.nn.Module):
    def forward(self, x, **kwargs):
        return self.inner(x, **kwargs)


class _ReadsThemUnderAnotherName(torch.nn.Module):
    def forward(self, x, **flash_kwargs):
        extra = dict(flash_kwargs)
        return self.inner(x, **extra)


class _DropsKeywords(torch.nn.Module):
    def forward(self, x, mask=None, **kwargs):
        return self.inner(x, mask=mask)


class _TakesNoKeywords(torch.nn.Module):
    def forward(self, x):
        return x


def test_forward_reads_keywords_reads_the_forward_s_body():
    assert tf_patches.forward_reads_keywords(_ReadsKeywords) is True
    assert tf_patches.forward_reads_keywords(_ReadsThemUnderAnotherName) is True
    assert tf_patches.forward_reads_keywords(_DropsKeywords) is False
    assert tf_patches.forward_reads_keywords(_TakesNoKeywords) is False
    # Source that cannot be read: unknown (the run-time check in the attention layer remains).
    assert tf_patches.forward_reads_keywords(_SourceLess) is None


# Falcon picked its attention class from FALCON_ATTENTION_CLASSES up to transformers 5.24
# (read in 4.57.6 and 5.24.0); 5.25 moved it onto the attention interface (read in 5.25.0).
# GPT-Neo keeps its table in every supported release.
FALCON_ON_INTERFACE = Version(transformers.__version__) >= Version("5.25.0")


def test_attention_tables_and_interface_of_real_modeling_modules():
    from transformers.models.bloom.modeling_bloom import BloomAttention
    from transformers.models.falcon.modeling_falcon import FalconAttention, FalconForCausalLM
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM

    tables = tf_patches.attention_class_tables(GPTNeoForCausalLM)
    assert "eager" in tables["transformers.models.gpt_neo.modeling_gpt_neo.GPT_NEO_ATTENTION_CLASSES"]
    falcon = tf_patches.attention_class_tables(FalconForCausalLM)
    if FALCON_ON_INTERFACE:
        assert falcon == {} and tf_patches.uses_attention_interface(FalconAttention)
    else:
        assert "eager" in falcon["transformers.models.falcon.modeling_falcon.FALCON_ATTENTION_CLASSES"]
    assert tf_patches.attention_class_tables(LlamaForCausalLM) == {}
    assert tf_patches.uses_attention_interface(LlamaAttention)
    assert not tf_patches.uses_attention_interface(BloomAttention)


# ---- torch ----


def test_forward_hooks_are_read_from_the_module():
    linear = torch.nn.Linear(2, 2)
    assert not torch_patches.has_forward_hooks(linear)
    handle = linear.register_forward_hook(lambda module, args, kwargs, out: out, with_kwargs=True)
    assert torch_patches.has_forward_hooks(linear)
    handle.remove()
    assert not torch_patches.has_forward_hooks(linear)
    # A hook on a child is the child's own.
    outer = torch.nn.Sequential(linear)
    linear.register_forward_hook(lambda module, args, out: out)
    assert not torch_patches.has_forward_hooks(outer)


def test_forward_hooks_of_another_shape_are_refused():
    linear = torch.nn.Linear(2, 2)
    object.__setattr__(linear, "_forward_hooks", [])
    with pytest.raises(torch_patches.UnsupportedTorchVersion, match="list, not a dict"):
        torch_patches.has_forward_hooks(linear)


def test_fsdp2_unsharded_keeps_whole_weights_through_forwards_and_restores_resharding(tmp_path):
    """Inside, the FSDP2 modules hold whole (plain) weights and a forward does not reshard them
    (one rank may run forwards alone); on exit they are sharded again (DTensors) and each
    group's reshard-after-forward setting is what it was (one process, a mesh of 1)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)

        def settings():
            return [g.post_forward_mesh_info is not None
                    for m in (model[0], model) for g in m._get_fsdp_state()._fsdp_param_groups]

        model(torch.ones(1, 4))  # the root's lazy init: it keeps its weights after forward, the layer does not
        before = settings()
        assert before == [True, False]
        with torch_patches.fsdp2_unsharded(model):
            for _ in range(2):
                model(torch.ones(1, 4))
                assert not any(isinstance(p, DTensor) for p in model.parameters())
        assert settings() == before
        assert all(isinstance(p, DTensor) for p in model.parameters())
    finally:
        if started:
            dist.destroy_process_group()


# ---- the token-mixer routes (patches/transformers/mixers.py) ----


def _kernels_func_module(func):
    # What `kernels` 0.19 (required by transformers 5.25) makes of a decorated function: an
    # nn.Module named Func whose forward calls the function from its closure.
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def test_mixer_functions_are_read_through_kernels_func_modules():
    from hf_ring.patches.transformers import mixers

    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        return hidden_states

    assert mixers._function_of(causal_conv1d_fn) is causal_conv1d_fn
    wrapped = _kernels_func_module(causal_conv1d_fn)
    assert mixers._function_of(wrapped) is causal_conv1d_fn
    assert wrapped(torch.ones(1), None) is not None  # still callable as the function
    # Any other module (its parameters cannot be read) is not taken for the function.
    assert mixers._function_of(torch.nn.Linear(1, 1)) is None
    assert mixers._function_of(None) is None
