"""What a user or a maintainer sees of the installed versions: ``import hf_ring`` without a
working transformers (subprocesses whose import system blocks or breaks it), ``python -m
hf_ring.env``, and the upstream canary's report (scripts/upstream_report.py). No process
group is spawned.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from packaging.version import Version

from hf_ring.patches import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- import hf_ring without a working transformers (a subprocess each) ----

_BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise {error}
sys.meta_path.insert(0, Block())
"""


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


_CORE = """
import torch, hf_ring
x = torch.arange(8.0).reshape(1, 8, 1)
shards = [hf_ring.shard_sequence(x, 2, r, dim=1) for r in range(2)]
assert torch.equal(hf_ring.unshard_sequence(shards, dim=1), x)
print("core", hf_ring.ring_flash_attn_func.__name__, hf_ring.RingDataCollator.__name__)
try:
    hf_ring.RingTrainer
except Exception as e:
    print("refused", type(e).__name__, e)
"""


def test_import_without_transformers_keeps_the_core():
    proc = _python(_BLOCK.format(error="ModuleNotFoundError(name, name=name)") + _CORE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "core ring_flash_attn_func RingDataCollator" in proc.stdout, proc.stdout
    assert "refused RingFlashUnavailable hf_ring.RingTrainer needs transformers, which is not installed" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]


def test_import_with_a_broken_transformers_keeps_the_core_and_names_the_error():
    proc = _python(_BLOCK.format(error='RuntimeError("transformers is broken here")') + _CORE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "core ring_flash_attn_func" in proc.stdout, proc.stdout
    assert "refused RingFlashUnavailable hf_ring.RingTrainer needs attn_implementation='ring_flash'" in proc.stdout
    assert "RuntimeError: transformers is broken here" in proc.stdout, proc.stdout
    assert proc.stderr.count("UserWarning") == 1 and "transformers is broken here" in proc.stderr, proc.stderr[-3000:]


_FLASH_CHECK_CHANGED = """
import transformers.utils.generic as generic
original = generic.is_flash_attention_requested
# A release whose flash-name check takes other parameters: hf_ring's patch must refuse it.
def is_flash_attention_requested(config=None, requested_attention_implementation=None):
    return original(config, requested_attention_implementation)
generic.is_flash_attention_requested = is_flash_attention_requested
""" + _CORE

_HOOK_POINT_GONE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
# A release without the method hf_ring hooks (after the flash-name check was patched).
PreTrainedModel.set_attn_implementation = None
import hf_ring
print("core", hf_ring.ring_flash_attn_func.__name__)
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=64)
model = LlamaForCausalLM._from_config(cfg, attn_implementation="ring_flash")
try:
    model(torch.tensor([[1, 2, 3]]))
except Exception as e:
    print("refused", type(e).__name__, e)
"""

_ON_5 = pytest.mark.skipif(Version(__import__("transformers").__version__) < Version("5"),
                           reason="the flash-name check exists on transformers 5 only")


@_ON_5
def test_a_failed_shape_check_keeps_the_core_and_names_the_error_once():
    proc = _python(_FLASH_CHECK_CHANGED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "core ring_flash_attn_func" in proc.stdout, proc.stdout
    changed = "is_flash_attention_requested has parameters ['config', 'requested_attention_implementation']"
    assert "refused RingFlashUnavailable hf_ring.RingTrainer needs" in proc.stdout and changed in proc.stdout, proc.stdout
    assert proc.stderr.count("UserWarning") == 1 and changed in proc.stderr, proc.stderr[-3000:]


@_ON_5
def test_a_model_asking_for_ring_flash_after_a_failed_registration_names_the_error():
    proc = _python(_HOOK_POINT_GONE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "core ring_flash_attn_func" in proc.stdout, proc.stdout
    assert "refused RingFlashUnavailable attn_implementation='ring_flash' needs" in proc.stdout, proc.stdout
    assert "PreTrainedModel.set_attn_implementation is missing" in proc.stdout, proc.stdout


def test_env_report_names_each_package_and_the_kernels():
    proc = subprocess.run([sys.executable, "-m", "hf_ring.env"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for name, tested in versions.TESTED.items():
        line = next((l for l in out.splitlines() if l.strip().startswith(name + " ")), None)
        assert line is not None, (name, out)
        assert tested.describe() in line and versions.status(name) in line, line
    assert "cpu float32: torch_cpu_flash, reference" in out, out
    assert 'attn_implementation="ring_flash", RingTrainer: registered' in out, out
    assert "hf_ring.trl: available: RingDPOTrainer, RingGRPOTrainer, RingRLOOTrainer, RingSFTTrainer" in out, out
    assert "hf_ring.patches.peft reads its ModulesToSaveWrapper internals" in out, out
    for name, tested in versions.TESTED.items():
        assert tested.role and tested.role in out, (name, out)
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode == 0:  # the suite runs from a checkout (an sdist would not be one)
        assert f"commit {commit.stdout.strip()}" in out, out


_FAKE_VERSIONS = """
from hf_ring.patches import versions
real = versions.installed
fake = {fake!r}
versions.installed = lambda package: fake.get(package, real(package))
import runpy; runpy.run_module('hf_ring.env', run_name='__main__')
"""


def _env_with(fake: dict[str, str]) -> str:
    proc = _python(_FAKE_VERSIONS.format(fake=fake))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _line(out: str, start: str) -> str:
    return next(l for l in out.splitlines() if l.strip().startswith(start))


def test_env_report_says_what_hf_ring_does_with_a_newer_0x_minor():
    # Issue 51: PEFT 0.22.0 (tested 0.21.2) was reported "refused" though nothing refused it.
    # A newer minor of a 0.x package is used with one warning, behind the shape checks.
    out = _env_with({"peft": "0.99.0", "deepspeed": "0.99.0"})
    for name in ("peft", "deepspeed"):
        assert _line(out, name + " ").endswith("untested, accepted; " + versions.TESTED[name].role), out
    assert "PEFT: available (untested, accepted)" in out, out
    assert "DeepSpeed ZeRO-2/3: available (untested, accepted)" in out, out


def test_env_report_names_the_refusal_hf_ring_raises():
    out = _env_with({"peft": "1.0.0", "deepspeed": "1.0.0", "torch": "3.0.0"})
    assert _line(out, "peft ").split(";")[0].endswith("refused"), out
    assert "PEFT: REFUSED: UnsupportedPEFTVersion: hf_ring does not know peft 1.0.0" in out, out
    assert "DeepSpeed ZeRO-2/3: REFUSED: UnsupportedDeepSpeedVersion: hf_ring does not know deepspeed 1.0.0" in out, out
    # Nothing in hf_ring checks torch's version at run time (pip applies pyproject's range).
    assert versions.UNCHECKED in _line(out, "torch "), out


def test_env_report_names_what_is_refused_without_trl():
    code = _BLOCK.replace('"transformers"', '"trl"').replace('"transformers."', '"trl."').format(
        error="ModuleNotFoundError(name, name=name)") + "import runpy; runpy.run_module('hf_ring.env', run_name='__main__')"
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hf_ring.trl: REFUSED: ModuleNotFoundError" in proc.stdout, proc.stdout


# ---- the upstream canary's report (scripts/upstream_report.py) ----

_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_model_sweep" name="test_family_is_exact_or_refused[qwen3]">
  <failure message="AssertionError: qwen3: cp=2 logits differ by 0.3">trace</failure></testcase>
<testcase classname="tests.test_trl" name="test_cp2_logs_what_cp1_logs[sft_padded]">
  <failure message="failed">hf_ring.patches.trl.UnsupportedTRLVersion: cannot use this TRL: SFTTrainer._metrics is not a dict</failure>
</testcase>
<testcase classname="tests.test_patches" name="test_installed_preparation_serves_accelerator_prepare"/>
</testsuite></testsuites>
"""


def test_canary_report_names_the_package_and_what_broke(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("upstream_report", os.path.join(ROOT, "scripts", "upstream_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    junit = tmp_path / "junit.xml"
    junit.write_text(_JUNIT)
    assert module.report(str(junit), pre=False) == 1
    lines = capsys.readouterr().out.splitlines()
    by_package = {line.split()[0]: i for i, line in enumerate(lines) if not line.startswith(" ")}
    assert set(module.PACKAGES) <= set(by_package), lines
    transformers_at, trl_at = by_package["transformers"], by_package["trl"]
    assert lines[transformers_at].endswith("BROKE") and lines[trl_at].endswith("BROKE"), lines
    assert "family qwen3: AssertionError: qwen3: cp=2 logits differ by 0.3" in lines[transformers_at + 1], lines
    assert "UnsupportedTRLVersion: cannot use this TRL: SFTTrainer._metrics is not a dict" in lines[trl_at + 1], lines
    assert lines[by_package["accelerate"]].endswith("ok") and lines[by_package["deepspeed"]].endswith("ok"), lines
    junit.write_text(_JUNIT.replace("<failure", "<skipped").replace("</failure>", "</skipped>"))
    assert module.report(str(junit), pre=True) == 0
    assert "BROKE" not in capsys.readouterr().out
