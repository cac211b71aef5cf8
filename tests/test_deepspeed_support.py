"""What hf_ring refuses or corrects about DeepSpeed, checked in this process (no launch).

The launched runs (test_trainer_zero.py) prove the working path; these prove the errors:
DeepSpeed's own sequence parallelism beside hf_ring's, DeepSpeed requested but not in
effect, a model that is no DeepSpeed engine, a train_batch_size that counts neither the
data-parallel ranks nor every process, and DeepSpeed releases the patches were not
written for.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("deepspeed")

from hf_ring.training import deepspeed_support  # noqa: E402
from hf_ring.patches import deepspeed as deepspeed_patches  # noqa: E402


def _state(dp: int, cp: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(dp_size=dp, cp_size=cp, world_size=dp * cp)


@pytest.mark.parametrize("keys", [
    {"sequence_parallel_size": 2},
    {"sequence_parallel_size": 2, "data_parallel_size": 1},
    {"ulysses": {"enabled": True}},
])
def test_refuses_deepspeed_sequence_parallelism(keys):
    with pytest.raises(ValueError, match="DeepSpeed's own sequence parallelism"):
        deepspeed_support._refuse_deepspeed_sequence_parallelism(dict(keys), cp_size=2)
    deepspeed_support._refuse_deepspeed_sequence_parallelism({"sequence_parallel_size": 1}, cp_size=2)


def test_train_batch_size_counts_data_parallel_ranks():
    state = _state(dp=2, cp=2)
    # What the HF Trainer's "auto" gives (every process counted) is corrected...
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_batch_size": 8}
    deepspeed_support._train_batch_size(config, state)
    assert config["train_batch_size"] == 4
    # ...the right count is kept, and anything else refused with the value to use.
    deepspeed_support._train_batch_size(config, state)
    assert config["train_batch_size"] == 4
    with pytest.raises(ValueError, match="set it to \"auto\" or to 4"):
        deepspeed_support._train_batch_size(dict(config, train_batch_size=6), state)


def _trainer(deepspeed_arg, enabled: bool, sp_size: int = 1):
    accelerator = types.SimpleNamespace(distributed_type="MULTI_CPU",
                                        parallelism_config=types.SimpleNamespace(sp_size=sp_size))
    return types.SimpleNamespace(args=types.SimpleNamespace(deepspeed=deepspeed_arg), is_deepspeed_enabled=enabled,
                                 accelerator=accelerator)


def test_refuses_deepspeed_requested_but_not_in_effect(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(ValueError, match="DeepSpeed was requested"):
        deepspeed_support.check_trainer(_trainer("ds_zero3.json", enabled=False), _state(1, 2))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="DeepSpeed was requested"):
        deepspeed_support.check_trainer(_trainer(None, enabled=False), _state(1, 2))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    deepspeed_support.check_trainer(_trainer(None, enabled=False), _state(1, 2))  # DDP: nothing to check


def test_refuses_accelerate_sequence_parallelism():
    with pytest.raises(ValueError, match="sp_size=2"):
        deepspeed_support.check_trainer(_trainer("ds_zero3.json", enabled=True, sp_size=2), _state(1, 2))


def test_refuses_a_model_that_is_no_deepspeed_engine():
    with pytest.raises(ValueError, match="not a DeepSpeed engine"):
        deepspeed_support.check_engine(torch.nn.Linear(2, 2), _state(1, 2))


def test_patches_refuse_unknown_deepspeed_versions():
    assert deepspeed_patches.check_version("0.19.8") == "0.19.8"
    assert deepspeed_patches.check_version("0.19.9") == "0.19.9"  # newer 0.19.x: one warning
    # A newer minor too (DeepSpeed 0.x): accepted behind the shape checks, not refused by number.
    assert deepspeed_patches.check_version("0.20.0") == "0.20.0"
    for version in ("0.18.9", "1.0.0.dev0", "1.0.0"):
        with pytest.raises(deepspeed_patches.UnsupportedDeepSpeedVersion, match="0.19.8"):
            deepspeed_patches.check_version(version)


def test_constructed_whole_is_a_no_op_without_zero3():
    with deepspeed_support.constructed_whole(types.SimpleNamespace(hf_deepspeed_config=None)):
        model = torch.nn.Linear(2, 2)
    assert not hasattr(model.weight, "ds_tensor")


def test_every_patch_refuses_an_installed_version_it_does_not_know(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "1.0.0")
    calls = [
        lambda: deepspeed_patches.count_data_parallel_ranks(2, 4),
        deepspeed_patches.skip_cpu_shm_comm_build,
        lambda: deepspeed_patches.zero3_model_state(object()),
        lambda: deepspeed_patches.zero_reduction_group(object()),
    ]
    for call in calls:
        with pytest.raises(deepspeed_patches.UnsupportedDeepSpeedVersion, match="1.0.0"):
            call()
