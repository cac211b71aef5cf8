"""The layers hold: no module imports what its layer must not (docs/design.md, and each
package's docstring), every access to a private upstream internal stays in ``patches/``'s
reach, and the house stays small (modules under 350 lines, folders of at most 12 modules).

Read from the source with ``ast`` (imports inside functions included), so a lazy import
that crosses a layer fails here as surely as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_ring"

# layer (a folder of hf_ring) -> module prefixes it must not import.
_CORE_ABOVE = ("hf_ring.hf", "hf_ring.memory", "hf_ring.training", "hf_ring.trl", "hf_ring.wrap")
FORBIDDEN = {
    "sharding": ("torch.distributed", "transformers", "accelerate", "hf_ring.kernels", "hf_ring.distributed",
                 "hf_ring.patterns", *_CORE_ABOVE),
    "kernels": ("torch.distributed", "transformers", "accelerate", "hf_ring.distributed", "hf_ring.patterns",
                *_CORE_ABOVE),
    "distributed": ("transformers", "accelerate", "hf_ring.patterns", *_CORE_ABOVE),
    "patterns": ("transformers", "accelerate", "hf_ring.mixers", *_CORE_ABOVE),
    "mixers": ("transformers", "accelerate", "hf_ring.patterns", *_CORE_ABOVE),
    "wrap": ("transformers", "accelerate", "hf_ring.hf", "hf_ring.memory", "hf_ring.training", "hf_ring.trl"),
    "hf": ("trl", "hf_ring.training", "hf_ring.memory", "hf_ring.trl"),
    "memory": ("trl", "hf_ring.training", "hf_ring.trl"),
    # Below the trainer: of the training layer only its loss arithmetic (torch only).
    "pipeline": ("trl", "accelerate", "hf_ring.trl", *(f"hf_ring.training.{m}" for m in (
        "trainer", "trainer_base", "trainer_checks", "plugin", "collator", "trl", "vision", "deepspeed_support"))),
}
MAX_LINES = 350
MAX_MODULES = 12


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return names


def _hits(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_what_it_must_not(layer):
    crossings = [f"{path.relative_to(ROOT)}:{line} imports {name}"
                 for path in (PACKAGE / layer).rglob("*.py") for line, name in _imports(path)
                 if _hits(name, FORBIDDEN[layer])]
    assert not crossings, "\n".join(crossings)


def test_the_trainer_is_imported_only_by_training():
    # transformers' Trainer is the training layer's: the integration and memory build on models alone.
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in _modules() if "training" not in path.parts
                 for line, name in _imports(path) if name in ("transformers.Trainer", "transformers.trainer")]
    assert not offenders, offenders


def test_modules_and_folders_stay_small():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in [*_modules(), *(ROOT / "patches").rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    folders = {p.parent for p in [*_modules(), *(ROOT / "patches").rglob("*.py")]}
    crowded = [f"{d.relative_to(ROOT)}: {n} modules" for d in sorted(folders)
               if (n := len(list(d.glob("*.py")))) > MAX_MODULES]
    assert not long and not crowded, long + crowded


def test_every_package_says_what_it_owns_and_must_not_import():
    silent = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")
              if p.parent != PACKAGE and "must not import" not in " ".join((ast.get_docstring(ast.parse(p.read_text()))
                                                                         or "").split()).lower()]
    assert not silent, f"packages whose docstring does not say what they must not import: {silent}"
