"""Which transformers releases ``hf_ring.patches.transformers`` was written for, and the error
every patch and accessor raises on any other release or on an internal of another shape.

Owns: ``WRITTEN_FOR``, the release lines, ``UnsupportedTransformersVersion``. Imports
transformers only when asked for the installed version (``import hf_ring`` needs only torch).
"""

from __future__ import annotations

import functools

from packaging.version import Version

WRITTEN_FOR = ("4.57.6", "5.24.0")


class UnsupportedTransformersVersion(RuntimeError):
    """The installed transformers is one these patches do not know how to patch."""


def release_line(version: str) -> str:
    """``"4.57"`` or ``"5"``: which set of patches a transformers version gets.

    Raises ``UnsupportedTransformersVersion`` for any other version.
    """
    v = Version(version)
    if Version("4.57") <= v < Version("4.58"):
        return "4.57"
    if Version("5.0.0.dev0") <= v < Version("6"):
        return "5"
    raise UnsupportedTransformersVersion(
        f"hf_ring's transformers patches were written for transformers {' and '.join(WRITTEN_FOR)} "
        f"(release lines 4.57.x and 5.x) and do not know how to patch transformers {version}; "
        'install a supported release, e.g. `pip install "transformers>=4.57,<6"`'
    )


def fail(what: str, version: str) -> UnsupportedTransformersVersion:
    """The error for an internal that does not have the shape it was written for."""
    return UnsupportedTransformersVersion(
        f"cannot patch transformers {version}: {what}. hf_ring's patches were written for "
        f"transformers {' and '.join(WRITTEN_FOR)}; install one of those releases or report "
        "this with your transformers version"
    )


@functools.lru_cache(maxsize=None)
def _checked_version(version: str) -> str:
    release_line(version)
    return version


def installed_version() -> str:
    """The installed transformers' version, once it is known to be on a supported line."""
    import transformers

    return _checked_version(transformers.__version__)
