"""The table of tested upstream versions (``hf_ring.patches.versions``): its rule (accepted
silently, accepted with one warning, refused by name) with fake versions, and pyproject's
ranges and CI's constraints files against it. One process, nothing spawned.
"""

from __future__ import annotations

import os
import tomllib
import warnings

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from hf_ring.patches import versions

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

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
    ("transformers", "4.57.6"), ("transformers", "5.24.0"), ("transformers", "5.25.0"), ("transformers", "5.3.0"),
    ("accelerate", "1.10.0"), ("accelerate", "1.12.0"), ("accelerate", "1.16.0"),
    ("trl", "1.16.0"), ("deepspeed", "0.19.8"), ("peft", "0.21.2"), ("peft", "0.22.0"),
    ("torch", "2.13.0+cpu"), ("torch", "2.14.1"),
])
def test_inside_the_tested_range_no_warning(no_warning_yet, package, version):
    assert _check(package, version) == []


@pytest.mark.parametrize("package,version,tested", [
    ("transformers", "5.26.0", "4.57.6 to 5.25.0"),
    ("transformers", "5.26.0.dev0", "4.57.6 to 5.25.0"),
    ("transformers", "4.57.1", "4.57.6 to 5.25.0"),
    ("accelerate", "1.17.0", "1.10.0 to 1.16.0"),
    ("trl", "1.17.0", "1.16.0"),
    ("trl", "1.99.0rc1", "1.16.0"),
    ("deepspeed", "0.19.9", "0.19.8"),
    # A newer minor of a 0.x package is a newer release of its line too (issue 51: PEFT
    # 0.22.0 was called "refused" though nothing refused it; DeepSpeed 0.20 was refused for
    # its number alone).
    ("deepspeed", "0.20.0", "0.19.8"),
    ("deepspeed", "0.99.1", "0.19.8"),
    ("peft", "0.22.1", "0.21.2 to 0.22.0"),
    ("peft", "0.23.0", "0.21.2 to 0.22.0"),
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
    assert len(_check("accelerate", "1.17.0")) == 1
    assert _check("trl", "1.18.0") == []


@pytest.mark.parametrize("package,version", [
    ("transformers", "4.56.2"), ("transformers", "4.58.0"), ("transformers", "6.0.0"), ("transformers", "6.0.0.dev0"),
    ("accelerate", "1.9.0"), ("accelerate", "2.0.0"),
    ("trl", "1.15.2"), ("trl", "2.0.0"), ("trl", "0.29.1"),
    ("deepspeed", "0.19.7"), ("deepspeed", "1.0.0"),
    ("peft", "0.21.1"), ("peft", "1.0.0"), ("torch", "2.4.1"), ("torch", "3.0.0"),
    ("trl", "not-a-version"),
])
def test_outside_the_lines_is_refused_by_name(no_warning_yet, package, version):
    with pytest.raises(_Refused) as error:
        versions.check(package, version, _Refused)
    message = str(error.value)
    tested = versions.TESTED[package]
    assert f"{package} {version}" in message and tested.lowest in message and tested.highest in message, message
    assert "pip install" in message, message
    # The status is what hf_ring does: nothing checks torch's version at run time.
    assert versions.status(package, version) == ("refused" if tested.checked_by else versions.UNCHECKED)


def test_status_words():
    assert versions.status("trl", "1.16.0") == "tested"
    assert versions.status("trl", "1.17.0") == "untested, accepted"
    assert versions.status("trl", "2.0.0") == "refused"
    assert versions.status("peft", "0.23.0") == "untested, accepted"
    assert versions.status("torch", "3.0.0") == versions.UNCHECKED


def _import(module: str):
    import importlib

    return importlib.import_module(module)


def _probe_versions(tested: versions.TestedRange) -> list[str]:
    low, high = tested.oldest_accepted, Version(tested.highest)
    return [tested.lowest, tested.highest, f"{high.major}.{high.minor + 1}.0", f"{high.major + 1}.0.0",
            _just_below(low)]


@pytest.mark.parametrize("package", sorted(versions.TESTED))
def test_status_says_what_the_package_s_module_does(no_warning_yet, package):
    # The word python -m hf_ring.env and the canary print is what hf_ring does: "refused"
    # exactly where the module named by checked_by raises, nothing else refused by number.
    tested = versions.TESTED[package]
    if not tested.checked_by:
        assert package == "torch" and not hasattr(_import("hf_ring.patches.torch"), "check_version")
        return
    module = _import(tested.checked_by)
    check = module.release_line if package == "transformers" else module.check_version
    for version in _probe_versions(tested):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", versions.UntestedVersionWarning)
            try:
                check(version)
                refused = False
            except RuntimeError as error:
                assert type(error).__name__.startswith("Unsupported"), error
                refused = True
        assert refused == (versions.status(package, version) == "refused"), (package, version)


def test_table_refuses_its_own_inconsistencies():
    with pytest.raises(ValueError, match="newer than highest"):
        versions.TestedRange("x", lowest="1.2.0", highest="1.1.0")
    with pytest.raises(ValueError, match="outside its own lines"):
        versions.TestedRange("x", lowest="1.2.0", highest="2.1.0", lines=("1",))
    # A 0.x package's line is 0: its newer minors are accepted with one warning.
    assert versions.TestedRange("x", lowest="0.3.1", highest="0.3.4").lines == ("0",)
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
    return f"{v.major}.{v.minor + 3}.0"


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
