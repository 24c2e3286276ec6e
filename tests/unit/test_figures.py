"""The reports' figures (report/figures/, matplotlib): inert SVG a page can embed, the same bytes
each time, bounded in size, and one Figure per id for notebooks."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from report_runs import synthetic_run

from mismatch_probe.report.comparison_view import label_runs
from mismatch_probe.report.data import RunData
from mismatch_probe.report.figures import (
    RUN_FIGURE_IDS,
    RUN_FIGURE_WHEN,
    comparison_figures,
    run_figures,
    sweep_figures,
)

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "reports" / "sweep-demo"
PAYLOAD = "<script>alert(1)</script> $x$"


def assert_inert_svg(svg: bytes, max_bytes: int = 400_000) -> ET.Element:
    root = ET.fromstring(svg)  # parses: every text is escaped
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert float(root.get("width", "0").removesuffix("pt")) > 300
    tags = {el.tag.split("}")[1] for el in root.iter()}
    assert not tags & {"script", "foreignObject", "a", "iframe", "object"}, tags
    for el in root.iter():
        assert not any(k.startswith("on") for k in el.attrib), el.attrib
        for k, v in el.attrib.items():
            if k.endswith("href"):  # an image inside the file, or a part of it: nothing fetched
                assert v.startswith(("data:image/png;base64,", "#")), v[:60]
    # the only URIs are the SVG and XLink namespaces
    assert set(re.findall(rb"https?://[^\"' ]+", svg)) <= {
        b"http://www.w3.org/2000/svg",
        b"http://www.w3.org/1999/xlink",
    }
    assert len(svg) < max_bytes
    return root


@pytest.mark.parametrize("n_tokens", [0, 5000])
def test_every_run_figure_is_inert_svg(n_tokens):
    record, dist = synthetic_run(n_tokens)
    figures = run_figures(record, dist)
    assert [f.info.id for f in figures] == [
        "prob_density",
        "log_ppl_by_turn",
        "abs_delta_by_p_infer",
        "seq_max_mismatch_hist",
        "max_mismatch_vs_length",
        "mismatch_by_position",
        "importance_ratio",
    ]
    # every figure but the adaptive run's (precision_rounds), which a run sampled with --precision adds
    assert [i for i in RUN_FIGURE_IDS if i not in RUN_FIGURE_WHEN] == [f.info.id for f in figures]
    for f in figures:
        assert_inert_svg(f.svg)
        assert f.info.path == f"figures/{f.info.id}.svg"


def test_rendering_a_run_again_gives_the_same_bytes():
    record, dist = synthetic_run(5000)
    assert [f.svg for f in run_figures(record, dist)] == [f.svg for f in run_figures(record, dist)]


def test_many_points_are_drawn_as_an_image_inside_the_svg():
    """A run's log-ppl scatter has a point per sample-turn: 4,000 here (2,000 samples, two turns).
    Drawn as vectors they would make the file grow with the run; rasterized it stays small."""
    record, dist = synthetic_run(100_000)
    assert len(dist["groups"]["first"]["log_ppl_infer"]) + len(dist["groups"]["later"]["log_ppl_infer"]) == 4000
    scatter = {f.info.id: f for f in run_figures(record, dist)}["log_ppl_by_turn"]
    root = assert_inert_svg(scatter.svg, max_bytes=120_000)
    assert [el for el in root.iter() if el.tag.endswith("image")]


def test_comparison_figures_show_run_names_as_text():
    record, dist = synthetic_run(5000, name=PAYLOAD)
    other, other_dist = synthetic_run(3000, name="plain")
    runs = label_runs([RunData(Path("a"), record, dist), RunData(Path("b"), other, other_dist)])
    figures = comparison_figures(runs)
    assert len(figures) == 4
    for f in figures:
        assert_inert_svg(f.svg)
    legend = {f.info.id: f.svg for f in figures}["overlay_seq_max_mismatch"]
    assert b"&lt;script&gt;alert(1)&lt;/script&gt; $x$" in legend and b"<script" not in legend


@pytest.mark.skipif(not (SWEEP / "sweep.json").is_file(), reason="no committed sweep")
def test_sweep_figures_are_inert_svg():
    from mismatch_probe.sweep_record import read_sweep

    figures = sweep_figures(read_sweep(SWEEP))
    assert [f.info.id for f in figures] == ["effects", "rescue", "cost"]
    for f in figures:
        assert_inert_svg(f.svg)


def test_a_run_with_no_model_tokens_still_draws_every_figure():
    record, dist = synthetic_run(0)
    runs = label_runs([RunData(Path("a"), record, dist), RunData(Path("b"), record, dist)])
    assert len(run_figures(record, dist)) == 7 and len(comparison_figures(runs)) == 4
