"""The tested range of every upstream package hf_ring reads the internals of, in one table,
and the one rule every ``patches/`` module applies to the installed release.

Why one table: pyproject's ranges, CI's constraints files, ``python -m hf_ring.env`` and
each ``patches/`` module's version check must agree on what was tested; a test reads
pyproject against this table.

The rule (``check``), with ``packaging.version``, never strings:

- inside ``[lowest, highest]`` (the oldest and newest release tested): accepted silently;
- newer than ``highest`` but inside one of its release lines (the same major version,
  ``0`` included: a newer ``0.minor`` of PEFT or DeepSpeed is accepted like a newer 5.x of
  transformers), or between ``floor`` and ``lowest``: accepted with ONE warning per package
  and process naming the tested range. The accessors in ``patches/`` still check every
  internal's shape and raise, naming what changed, when one differs, so a release is
  refused for what it changed, never for its number alone;
- anything else (another major line, older than ``floor``): refused with the module's own
  error, naming the tested range and what to install.

``checked_by`` names the ``patches/`` module that applies this rule when hf_ring uses the
package; ``status`` (what ``python -m hf_ring.env`` and the upstream canary print) says
"refused" only for a package that module refuses, so the word is what hf_ring does.

Must not import any upstream package (``import hf_ring`` needs only torch), nor hf_ring.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import warnings
from typing import Optional

from packaging.version import InvalidVersion, Version


class UntestedVersionWarning(UserWarning):
    """An upstream release inside an accepted line but outside the tested range."""


@dataclasses.dataclass(frozen=True)
class TestedRange:
    """What hf_ring was tested with for one upstream package.

    Args:
        package: the distribution name (``pip install NAME``).
        lowest: the oldest release tested.
        highest: the newest release tested.
        lines: the release lines accepted, as version prefixes (``"5"``: every 5.x;
            ``"4.57"``: every 4.57.x; ``"0.19"``: every 0.19.x). Default: the line of
            ``lowest`` and the line of ``highest``.
        floor: the oldest release accepted (default ``lowest``); older ones are refused.
        hint: what to install when refused.
        checked_by: the module that calls :func:`check` for this package when hf_ring uses
            it (``"hf_ring.patches.peft"``), or ``""`` when nothing at run time checks its
            version (torch: pyproject's range alone, applied by pip).
        role: what hf_ring does with the package, for ``python -m hf_ring.env``.
    """

    package: str
    lowest: str
    highest: str
    lines: tuple[str, ...] = ()
    floor: Optional[str] = None
    hint: str = ""
    checked_by: str = ""
    role: str = ""

    def __post_init__(self) -> None:
        for field in ("lowest", "highest", *(("floor",) if self.floor else ())):
            Version(getattr(self, field))  # raises InvalidVersion for a typo in the table
        if Version(self.lowest) > Version(self.highest):
            raise ValueError(f"{self.package}: lowest {self.lowest} is newer than highest {self.highest}")
        if not self.lines:
            object.__setattr__(self, "lines", tuple(dict.fromkeys((_line_of(self.lowest), _line_of(self.highest)))))
        for end in (self.lowest, self.highest, self.floor or self.lowest):
            if not self.in_lines(Version(end)):
                raise ValueError(f"{self.package}: {end} is outside its own lines {self.lines}")

    @property
    def oldest_accepted(self) -> Version:
        return Version(self.floor or self.lowest)

    def in_lines(self, version: Version) -> bool:
        return any(_prefix(version, len(line.split("."))) == _release(line) for line in self.lines)

    def accepts(self, version: str) -> bool:
        v = _public(version)
        return self.in_lines(v) and v >= self.oldest_accepted

    def tested(self, version: str) -> bool:
        """Inside ``[lowest, highest]``; a pre-release or dev build of ``highest``'s next
        release is not (``5.25.0.dev0 > 5.24.0``)."""
        return Version(self.lowest) <= _public(version) <= Version(self.highest)

    def tested_text(self) -> str:
        """``"4.57.6 to 5.24.0"``"""
        return self.lowest if self.lowest == self.highest else f"{self.lowest} to {self.highest}"

    def accepted_text(self) -> str:
        """``"4.57.x, 5.x from 4.57.0"``"""
        floor = f" from {self.floor}" if self.floor and self.floor != self.lowest else ""
        return ", ".join(f"{line}.x" for line in self.lines) + floor

    def describe(self) -> str:
        """``"tested 4.57.6 to 5.24.0, accepted: 4.57.x, 5.x from 4.57.0"``"""
        return f"tested {self.tested_text()}, accepted: {self.accepted_text()}"

    def install_hint(self) -> str:
        return self.hint or f'pip install "{self.package}>={self.oldest_accepted},<{_next_line(self.lines[-1])}"'


def _public(version: str) -> Version:
    # A local build label is the same release: torch's "2.13.0+cpu" is 2.13.0.
    return Version(Version(version).public)


def _release(line: str) -> tuple[int, ...]:
    return tuple(int(part) for part in line.split("."))


def _prefix(version: Version, length: int) -> tuple[int, ...]:
    return (tuple(version.release) + (0,) * length)[:length]


def _line_of(version: str) -> str:
    # The major version, 0 included: a newer 0.minor is accepted with one warning like any
    # newer release of the line (the shape checks of patches/ refuse what changed by name).
    return str(Version(version).major)


def _next_line(line: str) -> str:
    parts = _release(line)
    return ".".join(map(str, parts[:-1] + (parts[-1] + 1,)))


# The one table. Update lowest / highest when CI's constraints files change
# (.ci/constraints-newest.txt, .ci/constraints-oldest.txt); tests/test_versions.py checks
# that pyproject admits every accepted line and nothing past it.
TESTED: dict[str, TestedRange] = {
    r.package: r
    for r in (
        # 4.57.x is the last 4.x and the oldest with the attention registry.
        TestedRange("transformers", lowest="4.57.6", highest="5.25.0", lines=("4.57", "5"), floor="4.57.0",
                    hint='pip install "transformers>=4.57,<6"', checked_by="hf_ring.patches.transformers",
                    role="patched (ring_flash registration, model hooks, CP token mixers) and read"),
        TestedRange("accelerate", lowest="1.10.0", highest="1.16.0", checked_by="hf_ring.patches.accelerate",
                    role="data loaders fed per CP group, FSDP on CPU"),
        # hf_ring.training.trl also needs transformers >= 5.19 (checked there).
        TestedRange("trl", lowest="1.16.0", highest="1.16.0", hint='pip install "hf_ring[trl]" (trl>=1.16,<2)',
                    checked_by="hf_ring.patches.trl", role="hf_ring.trl's trainers"),
        TestedRange("peft", lowest="0.21.2", highest="0.22.0", checked_by="hf_ring.patches.peft",
                    role="LoRA models: the head the chunked loss runs, TP adapter widths"),
        TestedRange("deepspeed", lowest="0.19.8", highest="0.19.8", hint='DS_BUILD_OPS=0 pip install "deepspeed>=0.19.8,<1"',
                    checked_by="hf_ring.patches.deepspeed", role="ZeRO-2/3 under CP"),
        # pyproject admits torch >= 2.5; the suite runs on 2.14.1 (newest leg, the CUDA build on
        # disk, run on the CPU) and 2.13.0 (oldest leg, the CPU build on disk).
        # Nothing in hf_ring checks torch's version (pip applies pyproject's range); its
        # accessors (patches/torch.py) check each internal's shape.
        TestedRange("torch", lowest="2.13.0", highest="2.14.1", floor="2.5.0",
                    role="required; forward hooks and FSDP2 internals read, shapes checked"),
    )
}

_WARNED: set[str] = set()


def installed(package: str) -> Optional[str]:
    """The installed distribution's version, read from its metadata (nothing is imported),
    or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def refusal(package: str, version: str) -> str:
    """The message for a release outside ``package``'s accepted lines."""
    tested = TESTED[package]
    return (
        f"hf_ring does not know {package} {version} ({tested.describe()}); "
        f"install a release it accepts: `{tested.install_hint()}`"
    )


def check(package: str, version: str, error: type[Exception]) -> str:
    """``version`` when ``package``'s table entry accepts it; warns once per package and
    process when it is outside the tested range.

    Raises:
        error: the version is outside the accepted lines, below the floor, or no version.
    """
    tested = TESTED[package]
    try:
        accepted = tested.accepts(version)
    except InvalidVersion:
        accepted = False
    if not accepted:
        raise error(refusal(package, version))
    if not tested.tested(version) and package not in _WARNED:
        _WARNED.add(package)
        warnings.warn(
            f"hf_ring was tested with {package} {tested.tested_text()}; {package} {version} is outside that "
            f"range but inside the accepted {tested.accepted_text()}, so it is used, and every internal of "
            f"{package} that hf_ring reads is checked before use (a change is refused by name). "
            "`python -m hf_ring.env` shows every package against its tested range",
            UntestedVersionWarning,
            stacklevel=3,
        )
    return version


UNCHECKED = "outside pyproject's range, not checked at run time"


def status(package: str, version: Optional[str] = None) -> str:
    """What hf_ring does with ``package`` (default: its installed version): ``"not installed"``,
    ``"tested"``, ``"untested, accepted"`` (one warning), ``"refused"`` (its ``checked_by``
    module raises), or, for a package whose version nothing checks at run time (torch),
    ``UNCHECKED`` where the table would not accept it."""
    version = version if version is not None else installed(package)
    if version is None:
        return "not installed"
    tested = TESTED[package]
    try:
        accepted = tested.accepts(version)
    except InvalidVersion:
        accepted = False
    if not accepted:
        return "refused" if tested.checked_by else UNCHECKED
    return "tested" if tested.tested(version) else "untested, accepted"
