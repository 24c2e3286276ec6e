"""The supported-models table (docs/concepts/supported-models.md) is the rendering of docs/model-support.json, which the
family conformance suite (tests/families/) enforces cell by cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from model_support import COLUMNS, TABLE
from tiny_models import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "supported_models.py"
PAGE = ROOT / "docs" / "concepts" / "supported-models.md"  # the page the table is on


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import supported_models
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return supported_models


def test_every_family_has_every_column():
    table = json.loads(TABLE.read_text())
    assert list(table["families"]) == list(FAMILIES)
    for name, family in table["families"].items():
        assert set(family["results"]) == set(COLUMNS), name
        for result in family["results"].values():
            assert result["status"] in ("ok", "refused", "differs")
            assert (result["status"] != "ok") == bool(result.get("reason"))


def test_the_pages_table_is_current():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_render_numbers_each_reason_once():
    mod = _script()
    table = {
        "families": {
            "a": {
                "quirks": "x",
                "results": {"reference": {"status": "ok"}, "vllm": {"status": "refused", "reason": "r1"}},
            },
            "b": {
                "quirks": "y",
                "results": {
                    "vllm": {"status": "refused", "reason": "r1"},
                    "sglang": {"status": "refused", "reason": "r2"},
                },
            },
        }
    }
    text = mod.render(table)
    rows = text.splitlines()
    assert rows[2].startswith("| `a` | x | ok | not tried |") and rows[2].endswith("| refused [1] | not tried |")
    assert rows[3].endswith("| refused [1] | refused [2] |")
    assert "1. vLLM CPU: r1" in text and "2. SGLang CPU: r2" in text


def test_merge_keeps_cells_this_run_did_not_try():
    mod = _script()
    committed = {
        "families": {"llama": {"results": {"vllm": {"status": "refused", "reason": "old"}, "hf": {"status": "ok"}}}}
    }
    merged = mod.merge(committed, {"llama": {"vllm": {"status": "ok"}}})
    assert merged["families"]["llama"]["results"] == {"hf": {"status": "ok"}, "vllm": {"status": "ok"}}
    assert merged["families"]["gpt_oss"]["results"] == {}


def test_check_enforces_the_committed_table(monkeypatch):
    import model_support
    import pytest

    table = {
        "families": {
            "llama": {
                "results": {
                    "vllm": {"status": "ok"},
                    "sglang": {"status": "refused", "reason": "no kernel"},
                    "hf": {"status": "differs", "reason": "off"},
                }
            }
        }
    }
    monkeypatch.setattr(model_support, "committed", lambda: table)
    monkeypatch.delenv(model_support.OUT_ENV, raising=False)
    model_support.check("llama", "vllm", {"status": "ok"})  # as listed: passes
    with pytest.raises(pytest.xfail.Exception, match="no kernel"):
        model_support.check("llama", "sglang", {"status": "refused", "reason": "no kernel"})
    with pytest.raises(pytest.xfail.Exception, match=r"differs: off \(K3 1\)"):
        model_support.check("llama", "hf", {"status": "differs", "reason": "off", "detail": "K3 1"})
    with pytest.raises(pytest.fail.Exception, match="now runs"):  # an engine upgrade fixed it
        model_support.check("llama", "sglang", {"status": "ok"})
    with pytest.raises(pytest.fail.Exception, match="the table says it runs"):
        model_support.check("llama", "vllm", {"status": "refused", "reason": "new bug"})
    with pytest.raises(pytest.fail.Exception, match="the table says refused"):
        model_support.check("llama", "sglang", {"status": "refused", "reason": "another"})
    with pytest.raises(pytest.fail.Exception, match="not in model-support.json"):
        model_support.check("llama", "reference", {"status": "ok"})


def test_reasons_lose_paths_addresses_and_pids():
    from model_support import normalize

    assert (
        normalize("cannot open /tmp/pytest-of-root/zoo0/tiny-gemma2/config.json\nmore") == "cannot open <tiny-gemma2>"
    )
    assert normalize("object at 0x7f3a9c pid=1234 in /var/tmp/x") == "object at 0x… pid … in <tmp>"


def test_a_cell_an_engine_bug_explains_links_its_finding():
    mod = _script()
    table = {
        "families": {
            "a": {
                "quirks": "x",
                "results": {"vllm": {"status": "differs", "reason": "r1"}, "sglang": {"status": "ok"}},
            }
        }
    }
    bugs = {("a", "vllm"): "docs/engine-findings/one.md", ("a", "sglang"): "docs/engine-findings/two.md"}
    row = mod.render(table, bugs).splitlines()[2]
    assert "differs [1], [engine bug](docs/engine-findings/one.md)" in row
    assert "ok, [engine bug worked around](docs/engine-findings/two.md)" in row


def test_every_finding_names_cells_of_the_table_and_exists_once():
    cells = _script().findings()
    docs = sorted((ROOT / "docs" / "engine-findings").glob("*.md"))
    linked = set(cells.values())
    for doc in docs:
        # a finding no cell shows says so explicitly (<!-- cells: none -->) rather than by omission
        if doc.name != "README.md" and "<!-- cells: none -->" not in doc.read_text():
            assert Path(os.path.relpath(doc, PAGE.parent)).as_posix() in linked, (
                f"{doc.name} names no cell of the table"
            )
    for path in linked:  # relative to the page the table is on
        assert (PAGE.parent / path).is_file()
