"""The model sweep's ratchet: every family's expected outcome, checked in.

Why: the sweep passes a family that is exact or refused, so without a record of which
one it was, a family that is exact today could turn into a refusal (a detector's regex
matching one of its classes, say) with every test green: support lost without a word.
``tests/model_sweep_expected.json`` records, for each family that ran on transformers
``WRITTEN_FOR``, what each path of the sweep ("cp": cp=2, "no CP": ``ring_flash`` in one
process) gave: ``"exact"``, or ``"refused: "`` and the refusal's key (:func:`reason_key`).
``tests/test_model_sweep.py`` fails when a family moves from exact to refused, when its
refusal's key changes, and when a refused family becomes exact, until the record is
updated in the same change:

    python tests/model_sweep.py --only NAME ... --write-expected

Families that are skipped (not swept, or a package missing) or known to be WRONG or to
fail (``EXPECTED`` in ``tests/model_sweep.py``) are not recorded: those outcomes are
checked by the sweep's own test.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Optional

EXPECTED_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_sweep_expected.json")
PATHS = ("cp", "no CP")
UPDATE = "python tests/model_sweep.py --only {names} --write-expected"
# Long enough to name the refusal and what it is about (the module, the config field, the
# attention kind), short enough to stop before the advice that follows it.
_KEY_CHARS = 120


def reason_key(text: str) -> str:
    """A refusal's key: ``text`` (its type and first line) up to the first ``"; "`` (what
    follows says what to do), cut at a word after 120 characters, with every number
    written ``N`` (sizes, layer indices, ``cp_size``; not the digits of names like
    ``Qwen3``). The key changes when the reason does, not with the sizes of a config."""
    key = re.sub(r"\b\d+\b", "N", text).split("; ", 1)[0]
    return key if len(key) <= _KEY_CHARS else key[:_KEY_CHARS].rsplit(" ", 1)[0]


def outcome_record(summary: dict[str, Any]) -> Optional[dict[str, str]]:
    """Each path's ``"exact"`` or ``"refused: <key>"`` for a family that ran and was exact
    or refused on both, or None (skipped, WRONG, an error: not recorded)."""
    paths = summary.get("paths")
    if not paths or any(paths[p][0] not in ("exact", "refused") for p in PATHS):
        return None
    return {p: "exact" if paths[p][0] == "exact" else f"refused: {reason_key(paths[p][1])}" for p in PATHS}


def load(path: str = EXPECTED_JSON) -> dict[str, Any]:
    """``{"transformers": version, "families": {name: record}}``; empty families when absent."""
    if not os.path.exists(path):
        return {"transformers": None, "families": {}}
    with open(path) as f:
        return json.load(f)


def write(results: dict[str, dict[str, Any]], version: str, merge: bool, path: str = EXPECTED_JSON,
          record: Callable[[dict[str, Any]], Optional[dict[str, str]]] = outcome_record) -> list[str]:
    """Record the families of ``results`` (with ``merge``: over the file's other families;
    without: the file holds these families only), each as ``record`` makes it (the
    multimodal sweep has its own). Returns the names whose record changed."""
    current = load(path)
    families = dict(current["families"]) if merge and current["transformers"] == version else {}
    before = dict(families)
    for name, summary in results.items():
        entry = record(summary)
        if entry is None:
            families.pop(name, None)
        else:
            families[name] = entry
    with open(path, "w") as f:
        json.dump({"transformers": version, "families": dict(sorted(families.items()))}, f, indent=1)
        f.write("\n")
    return sorted(n for n in set(before) | set(families) if before.get(n) != families.get(n))


def compare(summary: dict[str, Any], families: dict[str, dict[str, str]], *,
            record: Callable[[dict[str, Any]], Optional[dict[str, str]]] = outcome_record,
            paths: tuple[str, ...] = PATHS, update: str = UPDATE, expected_json: str = EXPECTED_JSON) -> tuple[str, str]:
    """("ok" | "skip" | "fail", message): one family's outcome against its record (by
    default the text sweep's; the multimodal sweep passes its own ``record``, ``paths``,
    command to ``update`` and file)."""
    name = summary["name"]
    entry = record(summary)
    if entry is None:
        return "skip", f"{name} is {summary['outcome']}: not recorded (the sweep's own test checks it)"
    update = f"update the record in the same change: {update.format(names=name)}"
    expected = families.get(name)
    if expected is None:
        return "fail", f"{name} has no recorded outcome in {os.path.basename(expected_json)}; {update}"
    changes = []
    for path in paths:
        was, now = expected.get(path), entry[path]
        if was == now:
            continue
        if was == "exact":
            change = "was exact, is now REFUSED (support lost)"
        elif now == "exact":
            change = "was refused, is now exact (record it)"
        else:
            change = "is refused for another reason"
        changes.append(f"{path} path {change}:\n    expected: {was}\n    got:      {now}")
    if not changes:
        return "ok", ""
    return "fail", f"{name}: " + "\n".join(changes) + f"\nIf this change is meant, {update}"


def lost_support(summary: dict[str, Any], families: dict[str, dict[str, str]], recorded_on: str,
                 installed: str) -> Optional[str]:
    """On a newer release than the record's (the upstream canary), what the record cannot
    check one by one (refusals may rightly change wording) but must not pass silently: a
    family recorded exact on every path that is no longer exact. None otherwise."""
    name = summary["name"]
    before = families.get(name)
    if before is None or any(v != "exact" for v in before.values()) or summary["outcome"] == "exact":
        return None
    return (f"{name} was exact on transformers {recorded_on} (cp=2 and without CP) and is {summary['outcome']} "
            f"on {installed}: {summary.get('detail', '')[:300]}")

