"""benchmarks/memory_model.py: the fit recovers a memory model it was given, and the
projection's arithmetic behaves (a larger GPU fits more; offload and tiling never fit
less). The measured fit itself is checked by benchmarks/long_context_memory.py, which
prints its largest relative error over every measurement."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from memory_model import FITTED, LLAMA3_8B, OPTION_SETS, Shape, fit, longest_tokens, predict, project  # noqa: E402

pytestmark = pytest.mark.quick  # in the 5-minute check (docs/testing.md)

TRUE = {"a_H": 40.0, "a_I": 12.0, "t_I": 20.0, "r_H": 24.0, "b_H": 30.0, "g": 12.0, "d": 8.0, "e": 4.0, "f0": 3e7}
SHAPES = [Shape(128, 256, 2, 8, 4, 259), Shape(128, 256, 2, 8, 4, 128_256), Shape(128, 768, 4, 8, 4, 259)]


def test_fit_recovers_the_coefficients_it_was_made_from():
    points = [
        {"shape": vars(s), "options": o, "tokens": n, "peak_mb": predict(TRUE, s, o, n, 1024) / 2**20}
        for s in SHAPES for o in OPTION_SETS for n in (2048, 4096, 8192)
    ]
    points += [{"shape": vars(SHAPES[0]), "options": "chunked", "tokens": n, "cp": 2,
                "peak_mb": predict(TRUE, SHAPES[0], "chunked", n, 1024, 2) / 2**20} for n in (2048, 4096)]
    model = fit(points, tile=1024)
    for k in FITTED:
        assert model[k] == pytest.approx(TRUE[k], rel=1e-6), k


def test_longest_tokens_inverts_predict():
    shape = SHAPES[1]
    n = longest_tokens(TRUE, shape, "chunked+offload+tiled", 4 * 2**30, 1024)
    assert predict(TRUE, shape, "chunked+offload+tiled", round(n), 1024) == pytest.approx(4 * 2**30, rel=1e-5)  # n rounded to a token


def test_projection_orders():
    rows = {(r["gpu_gb"], r["options"], r["activation_dtype"]): r["longest_context"] for r in project(TRUE, LLAMA3_8B, 1024)}
    for dtype in ("bf16", "fp32-ub"):
        for options in ("none", "chunked", "chunked+offload", "chunked+offload+tiled"):
            assert rows[(141, options, dtype)] >= rows[(80, options, dtype)]
        assert rows[(141, "chunked+offload+tiled", dtype)] >= rows[(141, "chunked+offload", dtype)] >= rows[(141, "chunked", dtype)]
