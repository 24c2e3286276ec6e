"""The committed example's "What to do next" (docs/getting-started/report.md): its next-sweep.toml
runs as written, from where it lies, and its suggested gate passes the run it came from."""

from __future__ import annotations

import json
import shutil
import tomllib

import pytest
from conftest import ROOT, cli

pytestmark = pytest.mark.vllm

EXAMPLE = ROOT / "reports" / "example"


def test_the_committed_examples_next_sweep_runs_as_written(tmp_path):
    # the example beside a fixtures/ as in the repository: the file's paths are relative to itself
    (tmp_path / "reports").mkdir()
    run = tmp_path / "reports" / "example"
    shutil.copytree(EXAMPLE, run)
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    assert "## What to do next" in (run / "report.md").read_text()
    spec = tomllib.loads((run / "next-sweep.toml").read_text())
    axes = [a["key"] for a in spec["sweep"]["axes"]]
    proc = cli("sweep", str(run / "next-sweep.toml"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "reports" / "example-next-sweep"
    sweep = json.loads((out / "sweep.json").read_text())
    ran = {p["name"]: p for p in sweep["points"]}
    assert "baseline" in ran and sweep["repeats"] == 3  # the noise floor: the baseline with three seeds
    assert (out / "points" / "baseline-repeat2" / "run.json").is_file()
    assert {next(iter(p["settings"])) for p in sweep["points"] if p["settings"]} == set(axes)
    assert all(p["status"] == "ok" for p in sweep["points"]), [(p["name"], p.get("reason")) for p in sweep["points"]]
    # the baseline is the example's own configuration: the same engine and reference settings
    baseline = json.loads((out / ran["baseline"]["run"] / "run.json").read_text())["spec"]
    example = json.loads((run / "run.json").read_text())["spec"]
    for section in ("engine", "sampling", "reference", "corrections"):
        # every setting the example recorded (its record predates some settings: those are at their defaults)
        same = {k: baseline[section].get(k) for k in example[section] if k != "python"}
        assert same == {k: v for k, v in example[section].items() if k != "python"}, section
    gate = cli("gate", str(run), "--thresholds", str(run / "suggested-gate.toml"))
    assert gate.returncode == 0, gate.stdout[-2000:] + gate.stderr[-2000:]
