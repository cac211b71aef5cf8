"""The upstream canary's last step (scripts/check_upstream.sh): one line per upstream package
from pytest's JUnit XML, naming its installed version against the tested range and, for
each failed test that concerns it, the test and the accessor, family or error that broke.

A failure is put on a package by the error hf_ring raised (``Unsupported<Package>Version``:
an accessor's shape check or a version refusal); otherwise by what the test exercises.
Exits 1 when any test failed. Imports hf_ring.patches.versions only (no upstream package).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import xml.etree.ElementTree as ET

from hf_ring.patches import versions

PACKAGES = ("transformers", "accelerate", "trl", "peft", "deepspeed", "torch")
_ERROR_PACKAGE = {
    "UnsupportedTransformersVersion": "transformers",
    "UnsupportedAccelerateVersion": "accelerate",
    "UnsupportedTRLVersion": "trl",
    "UnsupportedPEFTVersion": "peft",
    "UnsupportedDeepSpeedVersion": "deepspeed",
    "UnsupportedTorchVersion": "torch",
}
# What a test exercises when its error names no package: by file, then by words in its name.
_FILE_PACKAGES = {
    "test_trl.py": ("trl",),
    "test_trainer_zero.py": ("deepspeed",),
    "test_deepspeed_support.py": ("deepspeed",),
    "test_trainer_cp.py": ("transformers", "accelerate"),
    "test_hf_attention.py": ("transformers",),
    "test_model_sweep.py": ("transformers",),
    "test_patches_positions.py": ("transformers",),
    "test_peft_chunked_loss.py": ("peft",),
    "test_trainer_lora.py": ("peft",),
}
_NAME_PACKAGES = (("accelerat", "accelerate"), ("forward_hooks", "torch"), ("", "transformers"))


def _packages_of(test_file: str, test_name: str, text: str) -> tuple[str, ...]:
    named = tuple(dict.fromkeys(_ERROR_PACKAGE[e] for e in re.findall(r"Unsupported\w+Version", text)
                                if e in _ERROR_PACKAGE))
    if named:
        return named
    if test_file in _FILE_PACKAGES:
        return _FILE_PACKAGES[test_file]
    if test_file == "test_versions.py":
        return PACKAGES
    return next((pkg,) for word, pkg in _NAME_PACKAGES if word in test_name)


def _what_broke(test_name: str, message: str) -> str:
    family = re.match(r"test_family_\w+\[(.+)\]", test_name)
    # hf_ring's own refusal names the accessor and what changed: prefer it to the first line.
    refusal = re.search(r"Unsupported\w+Version: .*", message)
    first = refusal.group(0) if refusal else next((line.strip() for line in message.splitlines() if line.strip()), "")
    reason = re.sub(r"\s+", " ", first)[:240]
    return f"family {family.group(1)}: {reason}" if family else reason


def failures(junit_path: str) -> list[tuple[str, str, str]]:
    """(file, test name, message) of every failed or erroring test case."""
    out = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            test_file = (case.get("classname") or "").split(".")[-1] + ".py"
            out.append((test_file, case.get("name", ""), (bad.get("message") or "") + "\n" + (bad.text or "")))
    return out


def report(junit_path: str, pre: bool) -> int:
    broken: dict[str, list[str]] = {p: [] for p in PACKAGES}
    cases = failures(junit_path)
    for test_file, name, text in cases:
        for package in _packages_of(test_file, name, text):
            broken[package].append(f"{test_file}::{name}: {_what_broke(name, text)}")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"upstream canary, {now}, newest releases{' and pre-releases' if pre else ''}:")
    for package in PACKAGES:
        version = versions.installed(package) or "not installed"
        head = f"{package} {version} ({versions.TESTED[package].describe()}; {versions.status(package)})"
        print(f"{head}: {'ok' if not broken[package] else 'BROKE'}")
        for line in broken[package]:
            print(f"    {line}")
    return 1 if cases else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest's --junitxml file")
    parser.add_argument("--pre", action="store_true", help="the environment took pre-releases")
    args = parser.parse_args()
    return report(args.junit, args.pre)


if __name__ == "__main__":
    sys.exit(main())
