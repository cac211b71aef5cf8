"""Plant known defects in a copy of the checkout and show that the suite catches each one,
the same tests failing whether spawned worlds live across cases or not.

Why: moving the spawned tests onto live worlds (tests/worlds.py) must lose no check. A
test that still passes with the zigzag order off by one or a ring step dropped checks
nothing, whichever way its world was made. For every defect below this script copies the
checkout (its tracked and untracked, not ignored, files) into a temporary folder, plants
the defect there, and runs the defect's tests twice from that folder: with live worlds (the
default) and with a fresh world per call (``HF_RING_FRESH_WORLDS=1``). It passes when every
defect fails tests in both runs, the same tests, and the copy without a defect passes them.

The copy is run with its own folder as the working directory and first on PYTHONPATH, and
the script checks that ``hf_ring`` is imported from it (an editable install of the
checkout would otherwise win, and nothing planted would run).

Usage: ``.venv/bin/python scripts/planted_defects.py`` (about 10 minutes on two cores).
Must not import hf_ring: it only runs pytest in the copies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Defect:
    """``old`` replaced by ``new`` in ``path`` (relative to the checkout; empty: nothing
    planted); ``tests`` the pytest arguments expected to catch it."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.path and self.old == self.new:
            raise ValueError(f"defect {self.name!r} changes nothing")


SPAWNED_ATTENTION_TESTS = ("tests/test_ring_attention.py", "tests/test_cp_patterns.py", "tests/test_cp_spans.py")
DEFECTS = (
    Defect("zigzag order off by one", "hf_ring/sharding/layouts.py",
           "last_chunk = 2 * cp_size - 1 - cp_rank", "last_chunk = 2 * cp_size - 2 - cp_rank",
           ("tests/test_sharding.py", *SPAWNED_ATTENTION_TESTS)),
    Defect("the ring's last forward step dropped", "hf_ring/patterns/ring/attention.py",
           "    acc = None\n    for step in range(plan.world):", "    acc = None\n    for step in range(max(plan.world - 1, 1)):",
           SPAWNED_ATTENTION_TESTS),
)
CLEAN = Defect("none (the copy as it is)", "", "", "", ("tests/test_sharding.py", *SPAWNED_ATTENTION_TESTS))


def copy_checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def plant(copy: Path, defect: Defect) -> None:
    if not defect.path:
        return
    target = copy / defect.path
    text = target.read_text()
    if text.count(defect.old) != 1:
        raise SystemExit(f"defect {defect.name!r}: {defect.old!r} occurs {text.count(defect.old)} times "
                         f"in {defect.path}, not once; update this script")
    target.write_text(text.replace(defect.old, defect.new))


def imported_from(copy: Path, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", "import hf_ring; print(hf_ring.__file__)"], cwd=copy, env=env,
                          check=True, capture_output=True, text=True).stdout.strip()


def failed_tests(copy: Path, tests: tuple[str, ...], env: dict, report: Path) -> set[str]:
    """The ids of the tests that failed or errored (pytest's own exit status checked too)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          f"--junitxml={report}", *tests], cwd=copy, env=env, capture_output=True, text=True)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report (exit {run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    failed = {f"{case.get('classname')}::{case.get('name')}" for case in ET.parse(report).iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None}
    if bool(failed) != (run.returncode != 0):
        raise SystemExit(f"pytest exited {run.returncode} with {len(failed)} failed tests in its report")
    return failed


def check(defect: Defect, work: Path) -> bool:
    copy = work / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    copy_checkout(copy)
    plant(copy, defect)
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]))
    where = imported_from(copy, base)
    if not where.startswith(str(copy)):
        raise SystemExit(f"the copy imports hf_ring from {where}, not from {copy}: nothing planted would run")
    print(f"\n== defect: {defect.name} ({defect.path}); tests: {' '.join(defect.tests)}", flush=True)
    runs = {}
    for mode, fresh in (("live worlds", "0"), ("fresh worlds", "1")):
        runs[mode] = failed_tests(copy, defect.tests, dict(base, HF_RING_FRESH_WORLDS=fresh),
                                  work / f"{mode.replace(' ', '_')}.xml")
        print(f"   {mode}: {len(runs[mode])} failed", *sorted(runs[mode]), sep="\n     ", flush=True)
    if defect is CLEAN:
        ok = not any(runs.values())
    else:
        ok = bool(runs["live worlds"]) and runs["live worlds"] == runs["fresh worlds"]
    print(f"   {'OK' if ok else 'NOT CAUGHT ALIKE'}", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run only the defects whose name contains this")
    args = parser.parse_args()
    defects = [d for d in (CLEAN, *DEFECTS) if args.only is None or args.only in d.name]
    if not defects:
        raise SystemExit(f"no defect's name contains {args.only!r}: {[d.name for d in DEFECTS]}")
    with tempfile.TemporaryDirectory(prefix="hf_ring_planted_") as tmp:
        results = {d.name: check(d, Path(tmp)) for d in defects}
    print("\n" + "\n".join(f"{'OK  ' if ok else 'FAIL'} {name}" for name, ok in results.items()))
    if not all(results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
