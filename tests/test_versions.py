"""The table of tested upstream versions (``hf_ring.patches.versions``), its rule (accepted
silently, accepted with one warning, refused by name) with fake versions, pyproject's
ranges against it, ``import hf_ring`` without a working transformers (in subprocesses that
block it), and ``python -m hf_ring.env``. No process group is spawned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import warnings

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from hf_ring.patches import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Refused(RuntimeError):
    pass


@pytest.fixture
def no_warning_yet(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())


def _check(package: str, version: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert versions.check(package, version, _Refused) == version
    return [w for w in seen if issubclass(w.category, versions.UntestedVersionWarning)]


def test_every_package_has_one_entry():
    assert set(versions.TESTED) == {"transformers", "accelerate", "trl", "peft", "deepspeed", "torch"}
    for name, tested in versions.TESTED.items():
        assert tested.package == name
        assert Version(tested.lowest) <= Version(tested.highest)


@pytest.mark.parametrize("package,version", [
    ("transformers", "4.57.6"), ("transformers", "5.24.0"), ("transformers", "5.3.0"),
    ("accelerate", "1.10.0"), ("accelerate", "1.12.0"), ("accelerate", "1.15.0"),
    ("trl", "1.16.0"), ("deepspeed", "0.19.8"), ("torch", "2.13.0+cpu"),
])
def test_inside_the_tested_range_no_warning(no_warning_yet, package, version):
    assert _check(package, version) == []


@pytest.mark.parametrize("package,version,tested", [
    ("transformers", "5.25.0", "4.57.6 to 5.24.0"),
    ("transformers", "5.25.0.dev0", "4.57.6 to 5.24.0"),
    ("transformers", "4.57.1", "4.57.6 to 5.24.0"),
    ("accelerate", "1.16.0", "1.10.0 to 1.15.0"),
    ("trl", "1.17.0", "1.16.0"),
    ("trl", "1.99.0rc1", "1.16.0"),
    ("deepspeed", "0.19.9", "0.19.8"),
    ("peft", "0.21.3", "0.21.2"),
])
def test_newer_in_the_line_is_accepted_with_one_warning(no_warning_yet, package, version, tested):
    first = _check(package, version)
    assert len(first) == 1, first
    message = str(first[0].message)
    assert f"{package} {tested}" in message and version in message, message
    # Not once per call: the accessors check on every use.
    assert _check(package, version) == []
    assert _check(package, version) == []


def test_one_warning_per_package(no_warning_yet):
    assert len(_check("trl", "1.17.0")) == 1
    assert len(_check("accelerate", "1.16.0")) == 1
    assert _check("trl", "1.18.0") == []


@pytest.mark.parametrize("package,version", [
    ("transformers", "4.56.2"), ("transformers", "4.58.0"), ("transformers", "6.0.0"), ("transformers", "6.0.0.dev0"),
    ("accelerate", "1.9.0"), ("accelerate", "2.0.0"),
    ("trl", "1.15.2"), ("trl", "2.0.0"), ("trl", "0.29.1"),
    ("deepspeed", "0.19.7"), ("deepspeed", "0.20.0"), ("deepspeed", "1.0.0"),
    ("peft", "0.22.0"), ("torch", "2.4.1"), ("torch", "3.0.0"),
    ("trl", "not-a-version"),
])
def test_outside_the_lines_is_refused_by_name(no_warning_yet, package, version):
    with pytest.raises(_Refused) as error:
        versions.check(package, version, _Refused)
    message = str(error.value)
    tested = versions.TESTED[package]
    assert f"{package} {version}" in message and tested.lowest in message and tested.highest in message, message
    assert "pip install" in message, message
    assert versions.status(package, version) == "refused"


def test_status_words():
    assert versions.status("trl", "1.16.0") == "tested"
    assert versions.status("trl", "1.17.0") == "untested, accepted"
    assert versions.status("trl", "2.0.0") == "refused"


def test_table_refuses_its_own_inconsistencies():
    with pytest.raises(ValueError, match="newer than highest"):
        versions.TestedRange("x", lowest="1.2.0", highest="1.1.0")
    with pytest.raises(ValueError, match="outside its own lines"):
        versions.TestedRange("x", lowest="1.2.0", highest="2.1.0", lines=("1",))
    assert versions.TestedRange("x", lowest="0.3.1", highest="0.3.4").lines == ("0.3",)
    assert versions.TestedRange("x", lowest="1.3.1", highest="2.0.0").lines == ("1", "2")


def _pyproject_requirements() -> dict[str, Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    entries = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    out: dict[str, Requirement] = {}
    for entry in entries:  # the first naming a package is its range (the trl extra narrows transformers)
        req = Requirement(entry)
        if req.name in versions.TESTED:
            out.setdefault(req.name, req)
    return out


def test_pyproject_admits_each_tested_range_and_nothing_past_its_lines():
    requirements = _pyproject_requirements()
    assert set(requirements) >= set(versions.TESTED) - {"peft"}, sorted(requirements)
    for name, req in requirements.items():
        tested = versions.TESTED[name]
        spec = req.specifier
        # A user's newer release inside the line must not be downgraded by `pip install hf_ring[...]`.
        for version in (tested.lowest, tested.highest, _bump_patch(tested.highest), _bump_within_line(tested)):
            assert spec.contains(version, prereleases=True), (name, str(spec), version)
        for refused in (_next_line(tested.lines[-1]), _just_below(tested.oldest_accepted)):
            assert not spec.contains(refused, prereleases=True), (name, str(spec), refused)


def _just_below(version: Version) -> str:
    major, minor, micro = (tuple(version.release) + (0, 0))[:3]
    if micro:
        return f"{major}.{minor}.{micro - 1}"
    return f"{major}.{minor - 1}.99" if minor else f"{major - 1}.99.99"


def _bump_patch(version: str) -> str:
    v = Version(version)
    return f"{v.major}.{v.minor}.{v.micro + 1}"


def _bump_within_line(tested: versions.TestedRange) -> str:
    v = Version(tested.highest)
    return f"{v.major}.{v.minor}.99" if v.major == 0 else f"{v.major}.{v.minor + 3}.0"


def _next_line(line: str) -> str:
    parts = [int(p) for p in line.split(".")]
    parts[-1] += 1
    return ".".join(map(str, parts))


def test_constraints_files_pin_releases_the_table_accepts():
    pinned = {}
    for leg in ("newest", "oldest"):
        with open(os.path.join(ROOT, ".ci", f"constraints-{leg}.txt")) as f:
            for line in f:
                line = line.split("#")[0].strip()
                if "==" in line:
                    name, version = line.split("==")
                    pinned.setdefault(leg, {})[name.strip().lower()] = version.strip()
    newest, oldest = pinned["newest"], pinned["oldest"]
    for name, tested in versions.TESTED.items():
        assert newest[name] == tested.highest or (name == "torch" and newest[name] == tested.lowest), (name, newest)
    assert oldest["transformers"] == versions.TESTED["transformers"].lowest
    for leg in (newest, oldest):
        for name, version in leg.items():
            if name in versions.TESTED:
                assert versions.status(name, version) == "tested", (name, version)


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
    assert "hf_ring.trl (RingSFTTrainer, RingDPOTrainer):" in out, out


def test_env_report_names_what_is_refused_without_trl():
    code = _BLOCK.replace('"transformers"', '"trl"').replace('"transformers."', '"trl."').format(
        error="ModuleNotFoundError(name, name=name)") + "import runpy; runpy.run_module('hf_ring.env', run_name='__main__')"
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hf_ring.trl (RingSFTTrainer, RingDPOTrainer): REFUSED: ModuleNotFoundError" in proc.stdout, proc.stdout


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
