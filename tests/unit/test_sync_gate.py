"""The gate's weight-sync values (``config/thresholds.py: SYNC_VALUES``): each passes, fails and
warns on hand-made ``sync`` sections, fails closed (saying why) on a run without the section or
without the measurement, and a misspelt one is an error naming the line; through ``load_gate`` /
``evaluate`` and through the CLI's ``gate`` command. No engine: a copy of the committed example
run's record with a ``sync`` section set."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.config.thresholds import SYNC_VALUES
from mismatch_probe.errors import ConfigError
from mismatch_probe.gate.checks import evaluate, load_gate
from mismatch_probe.record import RunRecord, read_record

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "reports" / "example"
pytestmark = pytest.mark.skipif(not (EXAMPLE / "run.json").is_file(), reason="no committed example run")


def fidelity(max_abs: float | None, k3: float | None) -> dict:
    return {"tokens": 1000, "bitwise_share": 1.0 if not max_abs else 0.5, "max_abs_dlogp": max_abs, "k3": k3}


SYNC = {
    "settings": {"start_from": "perturbed", "transfer": "tensor", "repeats": 3},
    "engine": "vllm",
    "clean": False,
    "repeats": [  # the largest value of each is not the last sync's: the gate takes the max over syncs
        {"repeat": 1, "fidelity": fidelity(0.25, 0.001)},
        {"repeat": 2, "fidelity": fidelity(0.5, 0.004)},
        {"repeat": 3, "fidelity": fidelity(0.125, 0.002)},
    ],
    "stale_cache": {"tokens": 900, "bitwise_share": 0.4, "max_abs_dlogp": 1.3, "k3": 0.02},
    "vs_fresh": {"tokens": 1000},
    "findings": [
        {"kind": "precision", "parameters": ["model.embed_tokens.weight"], "message": "rounded"},
        {"kind": "stale_prefix_cache", "parameters": [], "message": "stale"},
    ],
}
EXPECTED = {"sync_fidelity_max_abs": 0.5, "sync_fidelity_k3": 0.004, "sync_stale_cache_k3": 0.02, "sync_findings": 2}


@pytest.fixture(scope="module")
def example() -> RunRecord:
    return read_record(EXAMPLE)


def with_sync(record: RunRecord, sync: dict | None) -> RunRecord:
    out = record.model_copy(deep=True)
    if sync is not None:
        out.sync = copy.deepcopy(sync)
    return out


def thresholds(tmp_path: Path, bounds: dict[str, float], severity: str = "fail") -> Path:
    path = tmp_path / "gate.toml"
    path.write_text(
        "".join(
            f'[[checks]]\nmetric = "{name}"\nop = "<="\nthreshold = {bound!r}\nseverity = "{severity}"\n\n'
            for name, bound in bounds.items()
        )
    )
    return path


def statuses(tmp_path: Path, record: RunRecord, bounds: dict[str, float], severity: str = "fail") -> dict:
    result = evaluate(load_gate(thresholds(tmp_path, bounds, severity)), record)
    return {r.name: r for r in result.results}


def test_every_sync_value_is_declared_and_in_the_shipped_schema():
    assert set(SYNC_VALUES) == set(EXPECTED)
    schema = json.loads((ROOT / "mismatch_probe" / "config" / "thresholds.schema.json").read_text())
    described = schema["$defs"]["CheckSpec"]["properties"]["metric"]["description"]
    assert all(name in described for name in SYNC_VALUES)


def test_each_sync_value_passes_at_its_value(tmp_path, example):
    results = statuses(tmp_path, with_sync(example, SYNC), EXPECTED)
    for name, value in EXPECTED.items():
        assert results[name].status == "PASS", results[name]
        assert results[name].value == pytest.approx(value)
        assert results[name].metric == name


def test_each_sync_value_fails_just_below_its_value(tmp_path, example):
    below = {name: value * 0.99 for name, value in EXPECTED.items()}
    results = statuses(tmp_path, with_sync(example, SYNC), below)
    for name in EXPECTED:
        assert results[name].status == "FAIL" and "is not <=" in results[name].message, results[name]
    warned = statuses(tmp_path, with_sync(example, SYNC), below, severity="warn")
    assert {r.status for r in warned.values()} == {"WARN"}


def test_a_clean_sync_passes_zero_bounds(tmp_path, example):
    clean = copy.deepcopy(SYNC) | {"findings": []}
    for r in clean["repeats"]:
        r["fidelity"] = fidelity(0.0, 0.0)
    clean["stale_cache"]["k3"] = 0.0
    results = statuses(tmp_path, with_sync(example, clean), dict.fromkeys(SYNC_VALUES, 0))
    assert {r.status for r in results.values()} == {"PASS"}


def test_a_run_without_a_sync_fails_each_sync_check_closed_and_says_why(tmp_path, example):
    """The gate has no skipped state: a missing value fails closed, as a missing turn group's or
    decode-vs-prefill's does, and the message says the run did not probe the weight sync."""
    results = statuses(tmp_path, with_sync(example, None), EXPECTED)
    for name in EXPECTED:
        r = results[name]
        assert r.status == "FAIL" and r.value is None, r
        assert "no sync section" in r.message and "fails closed" in r.message


@pytest.mark.parametrize(
    ("name", "edit", "why"),
    [
        ("sync_stale_cache_k3", lambda s: s.update(stale_cache=None), "did not measure a stale prefix cache"),
        (
            "sync_fidelity_k3",
            lambda s: s["repeats"][1].update(fidelity=fidelity(None, None)),
            "sync 2 has no fidelity.k3",
        ),
        ("sync_fidelity_max_abs", lambda s: s.update(repeats=[]), "no syncs"),
        ("sync_findings", lambda s: s.pop("findings"), "lists no findings"),
    ],
)
def test_a_sync_value_that_was_not_measured_fails_closed(tmp_path, example, name, edit, why):
    sync = copy.deepcopy(SYNC)
    edit(sync)
    r = statuses(tmp_path, with_sync(example, sync), {name: 1e9})[name]
    assert r.status == "FAIL" and r.value is None and why in r.message, r


def test_a_nan_in_any_sync_fails_closed(tmp_path, example):
    sync = copy.deepcopy(SYNC)
    sync["repeats"][2]["fidelity"]["k3"] = float("nan")  # the last: max() alone would drop it
    r = statuses(tmp_path, with_sync(example, sync), {"sync_fidelity_k3": 1e9})["sync_fidelity_k3"]
    assert r.status == "FAIL" and "fails closed" in r.message


def test_a_misspelt_sync_value_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "gate.toml"
    path.write_text('[[checks]]\nmetric = "sync_finding"\nop = "=="\nthreshold = 0\n')
    with pytest.raises(ConfigError, match=r"gate.toml:2: check 1: unknown metric 'sync_finding'") as err:
        load_gate(path)
    assert err.value.hint == "did you mean 'sync_findings'?"


def test_the_gate_command_checks_the_sync_section(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(EXAMPLE / "run.json", run / "run.json")  # a copy: reports/ is never written
    record = read_record(run)
    record.sync = copy.deepcopy(SYNC)
    record.write(run)
    gate_file = tmp_path / "sync-gate.toml"
    gate_file.write_text(
        '[[checks]]\nname = "no findings"\nmetric = "sync_findings"\nop = "=="\nthreshold = 0\n\n'
        '[[checks]]\nname = "bitwise"\nmetric = "sync_fidelity_max_abs"\nop = "<="\nthreshold = 1.0\n'
    )
    result = CliRunner().invoke(app, ["gate", str(run), "--thresholds", str(gate_file), "--json"])
    assert result.exit_code == 1, result.output  # two findings: a FAIL is exit 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["no findings"]["status"] == "FAIL" and checks["no findings"]["value"] == 2
    assert checks["bitwise"]["status"] == "PASS" and checks["bitwise"]["value"] == 0.5

    record.sync["findings"] = []
    record.write(run)
    result = CliRunner().invoke(app, ["gate", str(run), "--thresholds", str(gate_file), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "PASS"
