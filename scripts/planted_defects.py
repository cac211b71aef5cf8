"""Plant known defects in a copy of hf_ring and check that the suite catches each one the
same way with live worlds (tests/worlds.py, ``HF_RING_LIVE_WORLDS=1``) as with a fresh
world per case (the default of tests/distributed.py).

For each defect: copy ``hf_ring/`` to a temporary folder, make one textual edit, run the
named test files against the copy (``PYTHONPATH`` puts it before the editable install, in
pytest and in every process it spawns) in both modes, and compare the failing test ids.
The check passes when every defect fails at least one test and both modes fail exactly the
same tests. Prints one line per defect and mode; exits 1 otherwise.

    .venv/bin/python scripts/planted_defects.py            # every defect (about 10 minutes on 2 cores)
    .venv/bin/python scripts/planted_defects.py --list

It imports nothing of hf_ring itself: it edits text and runs pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Defect:
    name: str
    path: str  # under hf_ring/
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]


DEFECTS = (
    Defect("zigzag order off by one", "sharding/layouts.py",
           "last_chunk = 2 * cp_size - 1 - cp_rank", "last_chunk = 2 * cp_size - 2 - cp_rank",
           ("tests/test_sharding.py", "tests/test_ring_attention.py", "tests/test_hf_attention_distributed.py",
            "tests/test_cp_patterns.py")),
    Defect("a dropped ring step (forward)", "patterns/ring/attention.py",
           "    acc = None\n    for step in range(plan.world):", "    acc = None\n    for step in range(plan.world - 1):",
           ("tests/test_ring_attention.py", "tests/test_ring_window.py", "tests/test_hf_patterns.py")),
)


def plant(defect: Defect, into: str) -> None:
    shutil.copytree(os.path.join(ROOT, "hf_ring"), os.path.join(into, "hf_ring"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(into, "hf_ring", defect.path)
    with open(path) as f:
        text = f.read()
    if text.count(defect.old) != 1:
        raise SystemExit(f"{defect.name}: {defect.old!r} occurs {text.count(defect.old)} times in "
                         f"hf_ring/{defect.path}, not once: update DEFECTS to the code")
    with open(path, "w") as f:
        f.write(text.replace(defect.old, defect.new))


def failing_tests(defect: Defect, copy: str, fresh: bool, report: str) -> tuple[set[str], float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([copy, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               HF_RING_LIVE_WORLDS="0" if fresh else "1")
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    f"--junitxml={report}", *defect.tests], cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failed = set()
    for case in ET.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(f"{case.get('classname')}::{case.get('name')}")
    return failed, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name the defects and their tests, run nothing")
    args = parser.parse_args()
    if args.list:
        for d in DEFECTS:
            print(f"{d.name}: hf_ring/{d.path}; {' '.join(d.tests)}")
        return 0
    ok = True
    for defect in DEFECTS:
        with tempfile.TemporaryDirectory(prefix="hf_ring_planted_") as tmp:
            plant(defect, tmp)
            seen = {}
            for fresh in (True, False):
                mode = "fresh world per case" if fresh else "live worlds"
                seen[fresh], took = failing_tests(defect, tmp, fresh, os.path.join(tmp, f"report{int(fresh)}.xml"))
                print(f"{defect.name} [{mode}]: {len(seen[fresh])} tests fail ({took:.0f} s)", flush=True)
        if not seen[True]:
            ok = False
            print(f"  NOT CAUGHT: no test fails with {defect.name}")
        if seen[True] != seen[False]:
            ok = False
            print(f"  DIFFERENT: only with fresh worlds: {sorted(seen[True] - seen[False])}; "
                  f"only with live worlds: {sorted(seen[False] - seen[True])}")
        else:
            print(f"  the same {len(seen[True])} tests in both modes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
