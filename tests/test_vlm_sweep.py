"""Every image-text family of the installed transformers under ``ring_flash`` at cp=2: exact
against one process (the families hf_ring serves, with their own input format), refused by
name on every rank, or not swept for a stated reason; never silently wrong; and as recorded.

The machinery lives in ``tests/vlm_sweep.py``; this module runs it once (one spawned gloo
world of 2 ranks for the families the session selected) and reports two tests per family:
``test_family_is_exact_or_refused`` fails on WRONG (ran outside tolerance, or ran without
being checked) and on an error; ``test_family_outcome_is_as_recorded`` is the ratchet
(``tests/sweep_ratchet.py`` against ``tests/vlm_sweep_expected.json``): a family that was
exact must stay exact, a refusal or a reason for not sweeping must stay the same, a new
family must be recorded. Tolerance: ``TOL`` of ``tests/vlm_sweep.py`` (1e-4 relative, the
reason is given there).

Selecting families runs only those: ``pytest "tests/test_vlm_sweep.py::test_family_is_exact_or_refused[llava]"``.
"""

from __future__ import annotations

import pytest
import transformers

import sweep_ratchet
import vlm_sweep
from hf_ring.hf.multimodal.families import FAMILIES
from vlm_sweep_configs import WRITTEN_FOR, family_names

OTHER_RELEASE = transformers.__version__ != WRITTEN_FOR
pytestmark = pytest.mark.skipif(OTHER_RELEASE, reason=f"the image-text families were read on transformers {WRITTEN_FOR}")

_RESULTS: dict = {}


def _selected_families(session: pytest.Session) -> list[str]:
    names = {item.callspec.params["family"] for item in session.items
             if getattr(item, "module", None) is not None and item.module.__name__ == __name__
             and getattr(item, "callspec", None) is not None and "family" in item.callspec.params}
    return [name for name in family_names() if name in names]


@pytest.fixture
def results(request: pytest.FixtureRequest) -> dict:
    """One sweep per session, of the selected families, shared by every test of this module."""
    if not _RESULTS:
        _RESULTS.update(vlm_sweep.run_sweep(_selected_families(request.session)))
    return _RESULTS


@pytest.mark.parametrize("family", family_names())
def test_family_is_exact_or_refused(family, results):
    kind, message = vlm_sweep.verdict(results[family])
    assert kind == "ok", message


@pytest.mark.parametrize("family", family_names())
def test_family_outcome_is_as_recorded(family, results):
    kind, message = vlm_sweep.judge(results[family], sweep_ratchet.load(vlm_sweep.EXPECTED_JSON)["families"])
    if kind == "fail" and vlm_sweep.verdict(results[family])[0] == "fail":
        pytest.skip("not recorded: its outcome fails test_family_is_exact_or_refused")
    if kind != "ok":
        pytest.fail(message, pytrace=False)


def test_every_served_family_is_checked():
    """Each family of hf_ring's table has a hand-written case here (by its model type), so the
    sweep checks it exactly rather than trusting the table; the cases and the record name
    real families."""
    import transformers.models.auto.modeling_auto as auto

    heads = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    base = {name: heads[name].replace("ForConditionalGeneration", "Model") for name in family_names()}
    served = {name for name in family_names() if base[name] in FAMILIES}
    # Each entry of the table names a family's base model (ShieldGemma 2 serves through Gemma 3's).
    assert {base[name] for name in served} == set(FAMILIES), sorted(set(FAMILIES) - {base[n] for n in served})
    assert served <= set(vlm_sweep.checked_cases()), sorted(served - set(vlm_sweep.checked_cases()))
    assert set(vlm_sweep.checked_cases()) <= set(family_names())
    assert set(sweep_ratchet.load(vlm_sweep.EXPECTED_JSON)["families"]) <= set(family_names())


def test_verdicts_and_records():
    """Without a run: the rules that keep the table honest."""
    def summary(outcome, detail, name="x"):
        return {"name": name, "outcome": outcome, "detail": detail}

    for outcome in ("exact", "refused", "not swept"):
        assert vlm_sweep.verdict(summary(outcome, "d"))[0] == "ok"
    for outcome in ("WRONG", "error"):
        assert vlm_sweep.verdict(summary(outcome, "d"))[0] == "fail"
    refused = summary("refused", "NotImplementedError: FooModel is an image-text model hf_ring has not checked under "
                                 "context parallelism (cp_size=2): how it merges; Checked: ...")
    families = {"x": vlm_sweep.outcome_record(refused)}
    compare = lambda s: vlm_sweep.judge(s, families)  # noqa: E731
    assert families["x"] == {"cp": "refused: NotImplementedError: FooModel is an image-text model hf_ring has not "
                                   "checked under context parallelism (cp_size=N): how"}  # 120 characters, cut at a word
    assert compare(refused)[0] == "ok"
    kind, message = compare(summary("exact", "logits 1e-7"))
    assert kind == "fail" and "was refused, is now exact" in message and "vlm_sweep.py --only x" in message
    families["x"] = {"cp": "exact"}
    kind, message = compare(refused)
    assert kind == "fail" and "was exact, is now REFUSED" in message
    assert compare(summary("not swept", "needs timm"))[0] == "fail"
    assert compare(summary("WRONG", "logits 0.3"))[0] == "fail"
    assert compare(summary("exact", "", name="new"))[0] == "fail"
    # What a family did on every rank decides its outcome.
    raised = {"type": "NotImplementedError", "message": "m", "where": "w", "by_hf_ring": True}
    crashed = {**raised, "type": "TypeError", "by_hf_ring": False}
    record = {"name": "x", "seconds": 0.0, "checked": False}
    assert vlm_sweep.summarize({**record, "errors": [raised, raised]})["outcome"] == "refused"
    assert vlm_sweep.summarize({**record, "errors": [raised, None]})["outcome"] == "error"  # one rank only
    assert vlm_sweep.summarize({**record, "errors": [raised, crashed]})["outcome"] == "error"
    ran = vlm_sweep.summarize({**record, "errors": [None, None]})  # ran without being checked
    assert ran["outcome"] == "WRONG" and "without being checked" in ran["detail"]
    errs = {"logits": 1e-7, "w": 2e-4}
    checked = {**record, "checked": True, "errors": [None, None], "errors_by_tensor": errs, "no_cp": 0.0}
    assert vlm_sweep.summarize(checked)["outcome"] == "WRONG"
    assert vlm_sweep.summarize({**checked, "errors_by_tensor": {**errs, "w": 1e-6}})["outcome"] == "exact"
    assert vlm_sweep.summarize({**checked, "errors_by_tensor": {**errs, "w": 1e-6}, "no_cp": 1e-3})["outcome"] == "WRONG"
