"""The CLI in-process through Typer's CliRunner, on the committed example run: no engine, no model.

Exit codes are the contract (0 pass, 1 a failed gate, 2 bad input) and an error is one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "reports" / "example"
needs_example = pytest.mark.skipif(not (EXAMPLE / "tokens.parquet").is_dir(), reason="no committed example run")


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_engines_lists_every_registered_engine():
    result = invoke("engines")
    assert result.exit_code == 0, result.output
    for name in ("hf", "vllm", "sglang"):
        assert name in result.output


@needs_example
def test_gate_on_the_example_checks_sequence_statistics_against_the_sequences(tmp_path):
    import mismatch_probe

    thresholds = tmp_path / "gate.toml"
    thresholds.write_text(
        '[[checks]]\nname = "k3"\nmetric = "k3_kl"\nop = "<"\nthreshold = 1e-3\n\n'
        '[[checks]]\nname = "long tail"\nsequence_metric = "max_mismatch"\nstatistic = "p90"\nop = "<"\n'
        "threshold = 1e-9\n"
    )
    result = invoke("gate", EXAMPLE, "--thresholds", thresholds, "--json")
    assert result.exit_code == 1, result.output  # the p90 bound is impossible: a FAIL is exit 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    run = mismatch_probe.load_run(EXAMPLE)
    assert checks["k3"]["status"] == "PASS" and checks["k3"]["value"] == run.record.metric("k3_kl")
    import pyarrow.compute as pc

    table = run.sequences_table()
    seq_max = np.asarray(table.filter(pc.equal(table.column("group"), "all")).column("max_mismatch"))
    assert checks["long tail"]["status"] == "FAIL"
    assert checks["long tail"]["value"] == pytest.approx(float(np.quantile(seq_max, 0.9)), rel=1e-12)


@needs_example
def test_report_renders_the_example_elsewhere(tmp_path):
    out = tmp_path / "example.html"
    result = invoke("report", EXAMPLE, "--out", out)
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "k3_kl" in html and "<script" not in html


@needs_example
def test_report_of_one_run_renders_all_of_it_again_in_place(tmp_path):
    """What compare's last stage writes, from the directory alone: the committed report.md is what
    this version renders (reports/regenerate.sh re-renders it), and a lost one comes back."""
    import shutil

    run = tmp_path / "example"
    shutil.copytree(EXAMPLE, run)
    (run / "report.md").unlink()
    shutil.rmtree(run / "figures")
    result = invoke("report", run)
    assert result.exit_code == 0, result.output
    assert (run / "report.md").read_text() == (EXAMPLE / "report.md").read_text()
    assert sorted(p.name for p in (run / "figures").iterdir()) == sorted(
        p.name for p in (EXAMPLE / "figures").iterdir()
    )
    assert (run / "run.json").read_bytes() == (EXAMPLE / "run.json").read_bytes()  # same figures: untouched


@needs_example
def test_report_json_prints_what_the_pages_show_and_writes_nothing(tmp_path):
    import shutil

    import mismatch_probe
    from mismatch_probe.numbers import fmt

    run = tmp_path / "example"
    shutil.copytree(EXAMPLE, run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    result = invoke("report", run, "--json")
    assert result.exit_code == 0, result.output
    view = json.loads(result.stdout)
    record = mismatch_probe.load_run(run).record
    assert view["kind"] == "run" and view["status"] == "complete"
    assert [c["label"] for c in view["metrics"]["columns"]][:2] == ["metric", "engine vs reference"]
    rows = {r["key"]: r["cells"] for r in view["metrics"]["rows"]}
    assert rows["k3_kl"][1] == fmt(record.metric("k3_kl")) and rows["n_model_tokens"][1] == "1,707"
    assert [f["id"] for f in view["figures"]] == [f.id for f in record.figures]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    ("spec_text", "message"),
    [
        ('model = "m"\nprompts = "p.jsonl"\n[engine]\nname = "hf"\ndtyp = "bfloat16"\n', "did you mean 'dtype'"),
        ('model = "m"\nprompts = "p.jsonl"\n[sampling]\nn = 1.5\n', "sampling.n must be an integer"),
    ],
)
def test_a_bad_spec_is_one_line_and_exit_2(tmp_path, spec_text, message):
    spec = tmp_path / "probe.toml"
    spec.write_text(spec_text)
    result = invoke("compare", spec)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_a_directory_that_is_not_a_run_is_exit_2(tmp_path):
    result = invoke("report", tmp_path)
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_set_flags_read_their_values_as_toml():
    from mismatch_probe.cli import parse_settings
    from mismatch_probe.errors import ConfigError

    assert parse_settings(["a.b=2", "c.d=1e-3", "e.f=true", "g.h=bfloat16", 'i.j="x=y"', "k.l = 3"]) == {
        "a.b": 2,
        "c.d": 1e-3,
        "e.f": True,
        "g.h": "bfloat16",
        "i.j": "x=y",
        "k.l": 3,
    }
    assert parse_settings(None) == {}
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        parse_settings(["reference.dtype"])
