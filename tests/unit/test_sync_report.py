"""The weight-sync probe's part of a run's pages: the run record keeps run.json's ``sync`` section,
and report.md, report.html and the terminal summary show one view of it (the verdict, each sync,
the stale-cache and fresh-engine comparisons, the engine's report, the timings); a run that did not
sync shows none of it. Built on a copy of the committed example run's record: no engine."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from html_tables import SectionTables
from rich.console import Console

from mismatch_probe.record import read_record
from mismatch_probe.report import html, markdown, terminal
from mismatch_probe.report.labels import SYNC_CLEAN
from mismatch_probe.report.run_view import RunView, run_view

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "reports" / "example"
pytestmark = pytest.mark.skipif(not (EXAMPLE / "run.json").is_file(), reason="no committed example run")

NOT_UPDATED = "model.layers.0.mlp.down_proj.weight kept the weights the engine started from: the sync did not update it"
STALE = (
    "with the prefix cache holding the old weights' entries, decode disagrees with prefill by K3 0.02, "
    "2e+03x the K3 after a reset (1e-05): reset the prefix cache after every weight update"
)


def a_sync(k: int, *, fidelity: dict, differing: list[str]) -> dict:
    return {
        "repeat": k,
        "report": {
            "transfer": "tensor",
            "call": "LLM.collective_rpc update_weights_from_tensors",
            "buckets": 3,
            "tensors": 50,
            "bytes": 5251584,
            "seconds": 0.08 if k == 1 else 0.071,
            "engine_report": {"loaded": 30, "not_loaded": [] if k == 1 else ["model.norm.weight"]},
            "reset_prefix_cache": {"call": "LLM.reset_prefix_cache", "result": True},
            "dtype_sent": "auto",
            "fault": None,
        },
        "fidelity": fidelity,
        "weights": {"compared": 30, "differing": differing},
    }


CLEAN = {
    "settings": {"start_from": "perturbed", "transfer": "tensor", "dtype": "auto", "bucket_mb": 512.0}
    | {"reset_prefix_cache": True, "repeats": 2, "warm_cache": True, "sleep_level": 0},
    "engine": "vllm",
    "clean": True,
    "repeats": [
        a_sync(k, fidelity={"tokens": 1234, "bitwise_share": 1.0, "max_abs_dlogp": 0.0, "k3": 0.0}, differing=[])
        for k in (1, 2)
    ],
    "stale_cache": None,
    "vs_fresh": {"k3_synced": 0.0012, "k3_fresh": 0.0011, "difference": 0.0001}
    | {"interval": [-0.0002, 0.0004], "within_noise": True, "tokens": 1234},
    "routing": {"unavailable": "the engine reports no routing for a dense model"},
    "findings": [],
    "timings": {"fresh_engine_start_s": 24.1, "engine_start_s": 23.8, "sync_s": [0.08, 0.071]},
    "a_later_key": {"kept": True},  # a key this version does not know survives the round trip
}

FOUND = copy.deepcopy(CLEAN) | {
    "clean": False,
    "repeats": [
        a_sync(
            k,
            fidelity={"tokens": 1234, "bitwise_share": share, "max_abs_dlogp": dmax, "k3": k3},
            differing=[f"model.layers.{n}.mlp.down_proj.weight" for n in range(6)],
        )
        for k, share, dmax, k3 in ((1, 0.25, 1.5, 0.031), (2, 0.5, 0.75, 0.0042))
    ],
    "stale_cache": {"tokens": 900, "bitwise_share": 0.4, "max_abs_dlogp": 1.3, "k3": 0.02}
    | {"floor": {"tokens": 900, "bitwise_share": 0.9, "max_abs_dlogp": 0.004, "k3": 1e-6}},
    "vs_fresh": {"k3_synced": 0.031, "k3_fresh": 0.0011, "difference": 0.0299}
    | {"interval": [0.021, 0.038], "within_noise": False, "tokens": 1234},
    "findings": [
        {"kind": "not_updated", "parameters": ["model.layers.0.mlp.down_proj.weight"], "message": NOT_UPDATED},
        {"kind": "stale_prefix_cache", "parameters": [], "message": STALE},
    ],
}


def synced_run(tmp_path: Path, sync: dict | None) -> Path:
    """A copy of the committed example's run.json (never written in place) with ``sync`` set."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    shutil.copy(EXAMPLE / "run.json", run / "run.json")
    record = read_record(run)
    if sync is not None:
        record.sync = copy.deepcopy(sync)
    record.write(run)
    return run


def views(run: Path) -> tuple[RunView, str, str, str]:
    """The run's view and its report.md, report.html (figures left out) and terminal summary."""
    view = run_view(read_record(run), run)
    view = dataclasses.replace(view, figures=[])
    console = Console(record=True, width=400, color_system=None, file=io.StringIO())
    terminal.print_run(console, view)
    return view, markdown.render_run(view), html.render_run(view, []), console.export_text()


def html_section(page: str) -> SectionTables:
    parser = SectionTables("sync")
    parser.feed(page)
    return parser


def md_table(text: str, heading: str) -> list[list[str]]:
    """The table under a Markdown heading, as cell texts (header first, the rule left out)."""
    lines = text[text.index(f"\n{heading}\n") :].splitlines()[1:]
    rows = []
    for line in lines[next(i for i, line in enumerate(lines) if line.startswith("|")) :]:
        if not line.startswith("|"):
            break
        if re.fullmatch(r"\|(-+:?\|)+", line):
            continue
        rows.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def md_section(text: str) -> str:
    start = text.index("\n## Weight sync\n")
    return text[start : text.index("\n## ", start + 1)]


def test_the_record_keeps_the_sync_section_as_run_json_holds_it(tmp_path):
    run = synced_run(tmp_path, FOUND | {"stale_cache": FOUND["stale_cache"] | {"k3": math.inf}})
    stored = json.loads((run / "run.json").read_text())
    assert stored["sync"]["stale_cache"]["k3"] == "inf"  # strict JSON
    again = read_record(run)
    assert again.sync is not None and again.sync["stale_cache"]["k3"] == math.inf
    assert again.sync["findings"] == FOUND["findings"] and again.sync["a_later_key"] == {"kept": True}
    assert again.sync["repeats"] == FOUND["repeats"]


def test_a_run_without_a_sync_has_no_sync_section(tmp_path):
    run = synced_run(tmp_path, None)
    assert "sync" not in json.loads((run / "run.json").read_text())  # absent, as before [sync] existed
    view, md, page, term = views(run)
    assert view.sync is None
    assert "Weight sync" not in md and 'id="sync"' not in page and "weight sync" not in term


def test_a_clean_sync_says_it_matches_a_fresh_load_bit_for_bit(tmp_path):
    view, md, page, term = views(synced_run(tmp_path, CLEAN))
    assert view.sync is not None and view.sync.clean and view.sync.findings == []
    assert view.sync.verdict == SYNC_CLEAN == "the synced engine matches a fresh load bit for bit"
    section = md_section(md)
    assert f"**{SYNC_CLEAN}**" in section
    parsed = html_section(page)
    assert SYNC_CLEAN in " ".join(parsed.text)
    assert f"weight sync: {SYNC_CLEAN}" in term

    # each sync: the same table in report.md and report.html, the record's numbers as the report writes them
    syncs = md_table(section, "### Each sync of the same weights")
    assert syncs[0] == [
        "sync",
        "transfer",
        "buckets",
        "bytes",
        "seconds",
        "tokens",
        "bitwise share",
        "max |Δ log p|",
        "K3",
        "differing parameters",
    ]
    assert syncs[1:] == [
        ["1", "tensor", "3", "5,251,584", "0.08", "1,234", "100%", "0", "0", "none of 30"],
        ["2", "tensor", "3", "5,251,584", "0.07", "1,234", "100%", "0", "0", "none of 30"],
    ]
    assert syncs in parsed.tables
    # no stale-cache measurement: no table of it
    assert "Stale prefix cache" not in section and "Stale prefix cache" not in " ".join(parsed.text)
    fresh = md_table(section, "### Synced vs fresh engine, against the reference")
    assert fresh == [
        ["tokens", "K3 synced", "K3 fresh", "difference", "interval", "within noise"],
        ["1,234", "0.0012", "0.0011", "1.000e-04", "[-2.000e-04, 4.000e-04]", "yes"],
    ]
    assert fresh in parsed.tables
    timings = md_table(section, "### Weight sync timings")
    assert [row[1] for row in timings[1:]] == ["24.10", "23.80", "0.08", "0.07"]
    assert timings in parsed.tables
    # what was synced, and MoE routing's reason for being absent
    assert "| engine | vllm |" in section and "start_from" not in section
    assert "transfer=tensor, dtype=auto, bucket_mb=512.0" in section
    assert "not measured: the engine reports no routing for a dense model" in section


def test_findings_stale_cache_and_a_k3_beyond_noise_are_shown(tmp_path):
    view, md, page, term = views(synced_run(tmp_path, FOUND))
    assert view.sync is not None and not view.sync.clean
    assert view.sync.findings == [NOT_UPDATED, STALE]
    section, parsed = md_section(md), html_section(page)
    text = " ".join(parsed.text)
    assert "**2 findings in the weight sync**" in section
    for message in (NOT_UPDATED, STALE):
        assert f"- {message}" in section and message in text and message in term.replace("\n", "")
    assert 'class="warn"' in page[page.index('<section id="sync">') :]

    syncs = md_table(section, "### Each sync of the same weights")
    assert [row[6:9] for row in syncs[1:]] == [["25%", "1.5000", "0.0310"], ["50%", "0.7500", "0.0042"]]
    assert syncs[1][9] == (
        "6 of 30: model.layers.0.mlp.down_proj.weight, model.layers.1.mlp.down_proj.weight, "
        "model.layers.2.mlp.down_proj.weight, model.layers.3.mlp.down_proj.weight, … 2 more"
    )
    assert syncs in parsed.tables

    stale = md_table(section, "### Stale prefix cache")
    assert stale == [
        ["tokens", "bitwise share", "max |Δ log p|", "K3", "floor: max |Δ log p|"],
        ["900", "40%", "1.3000", "0.0200", "0.0040"],
    ]
    assert stale in parsed.tables

    fresh = md_table(section, "### Synced vs fresh engine, against the reference")
    assert fresh[1] == ["1,234", "0.0310", "0.0011", "0.0299", "[0.0210, 0.0380]", "no"]

    # the engine's own report: of the last sync
    assert "### The engine's report of the last sync" in section
    assert "| not loaded | model.norm.weight |" in section and "| loaded | 30 |" in section
    assert "LLM.collective_rpc update_weights_from_tensors" in text
    assert "LLM.reset_prefix_cache: True" in text


def test_a_finding_is_text_on_the_page_never_markup(tmp_path):
    hostile = {"kind": "weights_differ", "parameters": ["x"], "message": "<script>alert(1)</script> | a\nb"}
    view, md, page, _ = views(synced_run(tmp_path, CLEAN | {"findings": [hostile]}))
    assert view.sync is not None and not view.sync.clean
    assert "<script" not in page and "&lt;script&gt;" in page
    # one list item: no markup, the pipe escaped, one line
    assert "- \\<script>alert(1)\\</script> \\| a b" in md_section(md)


def test_a_sync_not_shown_to_match_says_which(tmp_path):
    """No finding, but one sync's log-probs were not compared and another's differ: not clean."""
    repeats = copy.deepcopy(CLEAN["repeats"])
    repeats[0]["fidelity"] = {"tokens": 0, "bitwise_share": None, "max_abs_dlogp": None, "k3": None}
    repeats[1]["fidelity"]["bitwise_share"] = 0.995
    view, md, _, _ = views(synced_run(tmp_path, CLEAN | {"repeats": repeats}))
    assert view.sync is not None and not view.sync.clean and view.sync.findings == []
    assert "sync 1: log-probs not compared; sync 2: 99.5% of tokens bitwise equal" in view.sync.verdict
    assert md_table(md_section(md), "### Each sync of the same weights")[1][5:9] == ["0", "-", "-", "-"]


def test_what_the_sync_stage_records_beside_the_briefs_keys_is_shown(tmp_path):
    """The sample stage's own keys: parameters an engine cannot show, a sync without its duration,
    the rollouts' fidelity, a test's injected fault; and a section the analysis has not completed."""
    repeats = copy.deepcopy(CLEAN["repeats"])
    repeats[1]["weights"] = {"unavailable": "the sglang engine does not expose its parameters"}
    repeats[1]["report"]["seconds"] = None
    sync = CLEAN | {
        "repeats": repeats,
        "fidelity": {"tokens": 1707, "bitwise_share": 1.0, "max_abs_dlogp": 0.0, "k3": 0.0},
        "fault_injected": "skip",
        "timings": {"engine_start_s": 23.8, "sync_s": [0.08, None], "fresh_engine_start_s": 24.1},
        "complete": True,
    }
    view, md, _, _ = views(synced_run(tmp_path, sync))
    assert view.sync is not None and view.sync.clean
    section = md_section(md)
    rows = md_table(section, "### Each sync of the same weights")
    assert rows[2][4] == "-" and rows[2][9] == "not compared: the sglang engine does not expose its parameters"
    assert "| the rollouts, synced vs fresh prefill | 100% of 1,707 model tokens bitwise equal" in section
    assert "| fault injected (a test's) | skip |" in section
    timings = md_table(section, "### Weight sync timings")
    assert [row[1] for row in timings[1:]] == ["24.10", "23.80", "0.08", "-"]

    view, _, _, _ = views(synced_run(tmp_path / "partial", sync | {"complete": False}))
    assert view.sync is not None and not view.sync.clean and "not analyzed yet" in view.sync.verdict
