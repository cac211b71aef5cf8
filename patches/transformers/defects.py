"""Defects of transformers' own code that hf_ring works around or refuses, each with the
release it was read on, so that the code that depends on one (model support) names it
instead of restating it, and a release that fixes it is lifted here in one place.

Each defect is pinned by a test that fails when the installed release no longer has it
(named in its entry). Imports nothing of transformers or of hf_ring.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Defect:
    """One upstream defect.

    Args:
        what: what transformers gets wrong, as a clause an error message can quote.
        read_on: the transformers release the defect was read (and tested) on.
    """

    what: str
    read_on: str

    def text(self) -> str:
        return f"{self.what} (read on transformers {self.read_on})"


# Pinned by tests/test_cp_vlm_packed.py::test_stock_gemma3_packs_wrong_so_its_stock_collator_refuses.
GEMMA3_PACKED_MASK = Defect(
    what="transformers' own Gemma 3 mask on a packed row is not each document alone in its sliding layers (their "
    "window and image blocks are read at per-document positions as if they were row indices: logits off by ~0.8 "
    "from the second document on)",
    read_on="5.24.0",
)
