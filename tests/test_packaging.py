"""Every package of the source tree is in pyproject's explicit package list.

The list is explicit (``patches/`` is installed as ``hf_ring.patches``), and an editable
install finds a missing subpackage through the source tree anyway: only a wheel would lack
it, so nothing but this check would notice.
"""

from __future__ import annotations

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    found = set()
    for top, name in (("hf_ring", "hf_ring"), ("patches", "hf_ring.patches")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _source_packages() == listed, {"missing": _source_packages() - listed, "stale": listed - _source_packages()}
