"""Every engine and every metric is documented, rendered and gateable: adding one without its doc
entry, its row in the engines page (docs/concepts/engines.md) or its gate path fails here."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, METRIC_DOC, METRIC_DOCS
from mismatch_probe.analysis.metrics import CANONICAL_KEYS, CORRECTION_KEYS, MetricsAccumulator
from mismatch_probe.engines import BUILTIN_ENGINES
from mismatch_probe.gate.checks import metric_paths

ENGINES_PAGE = (ROOT / "docs" / "concepts" / "engines.md").read_text()
METRICS = sorted(set(MetricsAccumulator().metrics()) | set(CANONICAL_KEYS))  # what the analysis produces


def test_every_engine_in_the_registry_has_a_row_in_the_engines_page():
    section = ENGINES_PAGE
    for name in BUILTIN_ENGINES:  # (not parametrized: an id "sglang" would read as the sglang marker)
        assert re.search(rf"^\| `{re.escape(name)}` \|", section, re.MULTILINE), (
            f"docs/concepts/engines.md's table lacks {name!r}"
        )


def test_every_metric_has_a_doc_entry_and_every_doc_entry_is_a_metric():
    assert set(METRICS) == set(METRIC_DOC), set(METRICS) ^ set(METRIC_DOC)
    assert len(METRIC_DOCS) == len(METRIC_DOC)  # no key documented twice
    for doc in METRIC_DOCS:
        assert doc.label and doc.meaning, doc.key
        assert doc.better in ("lower", "higher", "zero", "one", None), doc.key
        # the generated metrics page (docs/concepts/metrics.md) states each one's full definition
        assert doc.formula.strip() and doc.estimates.strip() and doc.behaviour.strip(), doc.key
    assert set(CORRECTION_KEYS) == set(CORRECTION_DOCS)
    for key, correction in CORRECTION_DOCS.items():
        assert correction.label and correction.meaning and correction.formula.strip(), key


@pytest.mark.parametrize("key", METRICS)
def test_every_metric_is_a_gate_path(key):
    paths = metric_paths()
    assert f"metrics.{key}" in paths
    assert {f"metrics_by_turn.first.{key}", f"metrics_by_turn.later.{key}", f"decode_vs_prefill.{key}"} <= paths


@pytest.mark.parametrize("key", sorted(CORRECTION_KEYS))
def test_every_correction_is_a_gate_path(key):
    assert f"corrections.{key}" in metric_paths()


def test_the_reports_render_every_documented_metric():
    """report.html and report.md of a run show every documented metric and correction by its key."""
    import dataclasses
    from pathlib import Path

    from report_runs import synthetic_run

    from mismatch_probe.report import html, markdown
    from mismatch_probe.report.run_view import run_view

    record, dist = synthetic_run(2000)
    view = dataclasses.replace(run_view(record, Path("run"), dist), figures=[])  # the tables are what counts here
    page, md = html.render_run(view, []), markdown.render_run(view)
    for key in [d.key for d in METRIC_DOCS] + list(CORRECTION_DOCS):
        assert f"<code>{key}</code>" in page, key
        assert f"`{key}`" in md, key
