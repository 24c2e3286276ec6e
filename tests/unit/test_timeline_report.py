"""A timeline's page: one view (report/timeline_view.py) rendered as timeline.html, timeline.md
(report/html.py, report/markdown.py) and the terminal's summary, with its figures
(report/figures/timeline.py), from a record and a steps.parquet table built here by the analysis's own
``step_rows`` (synthetic tokens whose mismatch grows from a known step; nothing typed in by hand
but the drift results, whose test is analysis/drift.py's)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from html_tables import SectionTables

from mismatch_probe.analysis.timeline import STEP_SCHEMA, StepTokens, rows_table, step_rows
from mismatch_probe.report import markdown
from mismatch_probe.report.figures.timeline import ENVELOPE_BINS, envelope
from mismatch_probe.report.pages import write_timeline_pages
from mismatch_probe.report.timeline_view import timeline_summary, timeline_view
from mismatch_probe.timeline_record import KeptStep, TimelineRecord

N_STEPS, CHANGE = 30, 20
K3 = "K3 KL (mismatch-KL)"


def step_tokens(step: int, sigma: float, n: int = 600, seed: int = 0) -> StepTokens:
    """Two-turn samples of 30 model tokens, the trainer's log-probs the engine's plus noise."""
    rng = np.random.default_rng(seed * 1000 + step)
    position = np.arange(n) % 30
    li = np.log(rng.beta(5, 0.3, n))
    return StepTokens(
        sample_id=np.arange(n) // 30,
        turn=(position >= 20).astype(np.int16),
        position=position,
        logp_infer=li,
        logp_train=(li + rng.normal(0, sigma, n)).clip(max=0),
        n_samples=n // 30,
    )


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    """Steps 0..29 of a run whose mismatch's sd triples at step 20."""
    out = []
    for step in range(N_STEPS):
        out += step_rows(step, step_tokens(step, 0.01 if step < CHANGE else 0.03), n_boot=30)
    return out


def drift(metric: str, **kw) -> dict:
    base = {
        "metric": metric,
        "detected": False,
        "change_step": None,
        "interval": None,
        "alarm_step": None,
        "baseline_steps": [0, 9],
        "baseline": 4e-5,
        "after": None,
        "ratio": None,
        "alpha": 0.05,
        "reason": None,
    }
    return base | kw


def make_record(*, detected: bool = True, n_steps: int = N_STEPS, **kw) -> TimelineRecord:
    k3 = (
        drift("k3_kl", detected=True, change_step=CHANGE, interval=[19, 22], alarm_step=23, after=3.6e-4, ratio=9.0)
        if detected
        else drift("k3_kl")
    )
    fields = {
        "probe_version": "test",
        "status": "complete",
        "source": {"format": "slime", "path": "/data/run-7", "model": None},
        "steps": {"count": n_steps, "first": 0, "last": n_steps - 1, "model_tokens": 600 * n_steps, "failed": {}},
        "options": {"baseline_steps": 10, "alpha": 0.05, "keep": "auto", "worst": 3},
        "drift": {
            "k3_kl": k3,
            "mult_prob_error": drift("mult_prob_error", baseline=1.007),
            "token_tis_clipped_share": drift("token_tis_clipped_share", baseline=0.0),
            "routing_flip_share": drift("routing_flip_share", reason="no step has MoE routing"),
        },
        "kept": [
            KeptStep(step=0, why=["first"], run="runs/step-00000000"),
            KeptStep(step=CHANGE, why=["change k3_kl"], run="runs/step-00000020"),
            KeptStep(step=n_steps - 1, why=["last", "worst k3_kl"], reason="no --model: the import needs it"),
        ],
        "notes": ["step 3: 2 samples had no model token"],
    }
    return TimelineRecord(**(fields | kw))


def html_section(page: str, section: str) -> SectionTables:
    parser = SectionTables(section)
    parser.feed(page)
    return parser


def html_tables(page: str, section: str) -> list[list[list[str]]]:
    return html_section(page, section).tables


def md_rows(text: str, heading: str) -> list[list[str]]:
    lines = text[text.index(f"\n## {heading}\n") :].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    out = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|-"):
            out.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return out


def assert_inert_svg(svg: bytes) -> None:
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert not {el.tag.split("}")[1] for el in root.iter()} & {"script", "foreignObject", "a", "iframe"}


def test_the_headline_names_the_metric_its_change_step_and_interval(rows):
    record, table = make_record(), rows_table(rows)
    view = timeline_view(record, table)
    headline = f"{K3} departs from its baseline at step {CHANGE} (steps 19–22): 9x its median over steps 0–9"
    assert view.headlines[0].startswith(headline), view.headlines
    assert "(4.000e-05 → 3.600e-04)" in view.headlines[0]
    assert len(view.headlines) == 1  # the other metrics did not drift
    summary = timeline_summary(record).splitlines()
    assert summary[0] == "30 steps (0–29), 18,000 model tokens"
    assert summary[1] == view.headlines[0]
    assert f"- **{view.headlines[0]}**" in markdown.render_timeline(view)
    drift_rows = {row.key: row for row in view.drift.rows}
    assert drift_rows["k3_kl"].cells[1:5] == ["departs", "20", "steps 19–22", "23"]
    assert drift_rows["mult_prob_error"].cells[1] == "no drift" and drift_rows["mult_prob_error"].muted
    assert "not tested: no step has MoE routing" in drift_rows["routing_flip_share"].note


def test_a_share_that_drifts_is_read_as_its_two_medians():
    record = make_record(detected=False)
    record.drift["token_tis_clipped_share"] = drift(
        "token_tis_clipped_share",
        detected=True,
        change_step=12,
        interval=[12, 12],
        alarm_step=14,
        baseline=0.001,
        after=0.02,
    )
    (line,) = timeline_view(record, STEP_SCHEMA.empty_table()).headlines
    assert line == (
        "token TIS share departs from its baseline at step 12 (step 12): its median over steps 0–9 is 0.1%, "
        "from the change to the alarm 2%"
    )


def test_the_page_files_are_written_self_contained(rows, tmp_path):
    record, table = make_record(), rows_table(rows)
    figures = write_timeline_pages(tmp_path, record, table)
    assert figures == [
        "figures/k3_kl.svg",
        "figures/prob_diff.svg",
        "figures/mult_prob_error.svg",
        "figures/seq_max_mismatch_mean.svg",
        "figures/ratio_tails.svg",
        "figures/corrections.svg",
        "figures/turns.svg",  # the steps have later turns; no routing: no routing figure
    ]
    for f in figures:
        assert_inert_svg((tmp_path / f).read_bytes())
    page = (tmp_path / "timeline.html").read_text()
    md = (tmp_path / "timeline.md").read_text()
    assert "<script" not in page and "<link" not in page and 'http-equiv="Content-Security-Policy"' in page
    assert page.count('src="data:image/svg+xml;base64,') == len(figures)  # figures inside the page, as sweep.html
    assert set(re.findall(r'(?:src|href)="([a-z]+):', page)) == {"data"}  # nothing fetched
    headline = timeline_view(record, table).headlines[0]
    assert headline in "".join(html_section(page, "summary").text)
    assert f"**{headline}**" in md
    for f in figures:
        assert f"]({f})" in md
    # the kept steps: the two with a run directory link its report; the last says why it has none
    kept = html_tables(page, "kept")[0]
    assert kept[0] == ["step", "why", "report"]
    assert kept[1] == ["0", "the first step", "report"] and kept[2] == ["20", f"{K3}'s change point", "report"]
    assert kept[3][:2] == ["29", f"the last step; among the 3 largest {K3}"]
    assert "no run directory: no --model" in kept[3][2]
    assert 'href="runs/step-00000000/report.html"' in page and 'href="runs/step-00000020/report.html"' in page
    assert "[report](runs/step-00000020/report.html)" in md
    assert "step 3: 2 samples had no model token" in page and "step 3: 2 samples had no model token" in md


def test_the_steps_table_is_the_same_in_timeline_md_and_timeline_html(rows, tmp_path):
    record, table = make_record(), rows_table(rows)
    write_timeline_pages(tmp_path, record, table)
    page, md = (tmp_path / "timeline.html").read_text(), (tmp_path / "timeline.md").read_text()
    from_html = html_tables(page, "steps")[0]
    from_md = md_rows(md, "Steps")
    unlink = [[re.sub(r"^\[(\w+)\]\(.*\)$", r"\1", c).replace("\\|", "|") for c in row] for row in from_md]
    assert unlink == from_html
    assert len(from_html) == 1 + N_STEPS  # a short timeline shows every step
    k3 = [r for r in rows if r["group"] == "all"][CHANGE]
    change = from_html[1 + CHANGE]
    assert change[0] == "20" and change[1].startswith(f"{k3['k3_kl']:.3e} [")
    assert change[-2] == f"{K3}'s change point" and change[-1] == "report"


def test_a_long_timeline_shows_its_ends_its_kept_steps_and_change_points(rows):
    """Hundreds of steps: the first and last five, every kept step and change point, a gap row
    between them; steps.parquet holds the rest."""
    template = [r for r in rows if r["step"] < 10]
    long = rows_table([r | {"step": s} for s in range(400) for r in template if r["step"] == s % 10])
    record = make_record(n_steps=400)
    record.kept = [
        KeptStep(step=0, why=["first"]),
        KeptStep(step=123, why=["worst k3_kl"]),
        KeptStep(step=399, why=["last"]),
    ]
    record.drift["k3_kl"]["change_step"] = 250
    view = timeline_view(record, long)
    shown = [r.cells[0] for r in view.steps.rows if not r.note]
    assert shown == ["0", "1", "2", "3", "4", "123", "250", "395", "396", "397", "398", "399"]
    gaps = [r.note for r in view.steps.rows if r.note]
    assert gaps == [f"{n} steps not shown (steps.parquet has every step)" for n in (118, 126, 144)]
    assert "12 of 400 steps" in view.steps.lead


def test_a_timeline_without_drift_says_so(rows, tmp_path):
    record = make_record(detected=False)
    write_timeline_pages(tmp_path, record, rows_table(rows))
    line = "no drift found in any metric (false-alarm rate 5% per metric)"
    assert timeline_summary(record).splitlines()[1:] == [line]
    assert line in (tmp_path / "timeline.md").read_text() and line in (tmp_path / "timeline.html").read_text()


def test_a_timeline_with_no_steps_renders(tmp_path):
    record = make_record(detected=False, n_steps=0, drift={}, kept=[], notes=[])
    record.steps = {"count": 0, "first": None, "last": None, "model_tokens": 0, "failed": {"4": "no trainer log-probs"}}
    figures = write_timeline_pages(tmp_path, record, STEP_SCHEMA.empty_table())
    assert len(figures) == 6  # no later turns, no routing
    for f in figures:
        assert_inert_svg((tmp_path / f).read_bytes())
    page = (tmp_path / "timeline.html").read_text()
    assert "no steps analysed yet" in page and "no steps analysed yet" in timeline_summary(record)
    assert html_tables(page, "failed")[0] == [["step", "why"], ["4", "no trainer log-probs"]]
    assert "| 4 | no trainer log-probs |" in (tmp_path / "timeline.md").read_text()


def test_a_drift_result_with_infinities_renders(rows, tmp_path):
    """A drift result writes an infinite median or ratio as "inf" (as run.json does)."""
    record = make_record()
    record.drift["k3_kl"] |= {"after": "inf", "ratio": "inf"}
    write_timeline_pages(tmp_path, record, rows_table(rows))
    assert "inf its median over steps 0–9 (4.000e-05 → inf)" in timeline_summary(record)


def test_routing_gets_its_column_and_figure_when_the_steps_have_it(rows, tmp_path):
    routed = [r | {"routing_flip_share": 0.01 * (r["step"] % 5)} if r["group"] == "all" else r for r in rows]
    figures = write_timeline_pages(tmp_path, make_record(), rows_table(routed))
    assert figures[-1] == "figures/routing_flip_share.svg"
    header = html_tables((tmp_path / "timeline.html").read_text(), "steps")[0][0]
    assert "routing flip share" in header


def test_rendering_again_gives_the_same_figures(rows, tmp_path):
    record, table = make_record(), rows_table(rows)
    first = {f: (tmp_path / f).read_bytes() for f in write_timeline_pages(tmp_path, record, table)}
    assert {f: (tmp_path / f).read_bytes() for f in write_timeline_pages(tmp_path, record, table)} == first


def test_a_long_series_is_drawn_as_its_envelope():
    """Thousands of steps: each run of steps as its smallest and largest value, so the figure's
    size is bounded and no spike is lost."""
    x = np.arange(5000.0)
    y = np.sin(x / 50.0)
    y[1234], y[4000:4100] = 40.0, np.nan
    xs, ys = envelope(x, y, ENVELOPE_BINS)
    assert len(xs) == len(ys) <= 2 * ENVELOPE_BINS
    assert np.nanmax(ys) == 40.0 and np.nanmin(ys) == pytest.approx(-1.0, abs=1e-3)
    assert np.isnan(ys).any()  # a run of steps with no value is a gap
    assert np.all(np.diff(xs) >= 0)
    short = np.arange(10.0)
    assert envelope(short, short, ENVELOPE_BINS)[1] is short


def test_the_figures_of_a_long_timeline_stay_small(rows, tmp_path):
    template = [r for r in rows if r["step"] >= CHANGE - 5]
    long = rows_table([r | {"step": s} for s in range(2000) for r in template if r["step"] == CHANGE - 5 + s % 10])
    for f in write_timeline_pages(tmp_path, make_record(n_steps=2000), long):
        assert (tmp_path / f).stat().st_size < 80_000, f
