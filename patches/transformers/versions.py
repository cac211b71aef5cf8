"""Which transformers releases ``hf_ring.patches.transformers`` accepts (the table in
``hf_ring.patches.versions``), which set of patches each release line gets, and the error
every patch and accessor raises on a refused release or on an internal of another shape.

Owns: ``WRITTEN_FOR``, the release lines, ``UnsupportedTransformersVersion``. Imports
transformers only when asked for the installed version (``import hf_ring`` needs only torch).
"""

from __future__ import annotations

import functools

from packaging.version import Version

from .. import versions

_TESTED = versions.TESTED["transformers"]
WRITTEN_FOR = (_TESTED.lowest, _TESTED.highest)


class UnsupportedTransformersVersion(RuntimeError):
    """The installed transformers is one these patches do not know how to patch."""


def release_line(version: str) -> str:
    """``"4.57"`` or ``"5"``: which set of patches a transformers version gets. A 5.x newer
    than the tested range is accepted with one warning (``hf_ring.patches.versions``).

    Raises ``UnsupportedTransformersVersion`` for a release outside 4.57.x and 5.x.
    """
    versions.check("transformers", version, UnsupportedTransformersVersion)
    return "4.57" if Version(version) < Version("5.0.0.dev0") else "5"


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
