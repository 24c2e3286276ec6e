"""A [sync] probe through the CLI on vLLM's CPU build (pipeline/sync.py): the engine starts from
the perturbed checkpoint, takes the model's weights through its update path with a warm prefix
cache that is not reset, samples, and a fresh engine scores the same tokens; run.json's sync
section, the report's section and the gate's sync values come out of it."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from typer.testing import CliRunner

from mismatch_probe.cli import app

pytestmark = pytest.mark.vllm


def test_sync_probe_names_the_stale_cache_and_the_stale_head(tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = ["compare", str(ROOT / "probes/sync-demo.toml"), "--out", str(out), "--max-prompts", "6"]
    # both engines (the synced one and the fresh one) run their engine core and model runner in the
    # engine worker ("uni"; the CPU build needs VLLM_ENABLE_V1_MULTIPROCESSING=0 for it): the same
    # CPU worker, weight update path and prefix cache as vLLM's default (mp), without two more
    # processes importing vLLM per start (~20 s each) and ~5 s to stop them. The sync path through
    # mp's worker process is tests/engines/test_vllm_sync.py's, on the shared engine.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    args += ["--distributed-executor-backend", "uni"]
    result = CliRunner().invoke(app, [*args, "--no-sync-reset-prefix-cache", "--sync-repeats", "2"])
    assert result.exit_code == 0, result.output
    rec = json.loads((out / "run.json").read_text())
    assert rec["engine"]["distributed_executor_backend"] == "uni"
    sync = rec["sync"]
    assert sync["complete"] and len(sync["repeats"]) == 2
    kinds = {f["kind"] for f in sync["findings"]}
    # vLLM 0.32 CPU's stale tied-LM-head kernel (tests/engines/test_vllm_sync.py), and the cache
    assert "not_updated" in kinds and "stale_prefix_cache" in kinds, sync["findings"]
    assert "drift_over_repeats" not in kinds
    # the shared system prompt's block held the old weights' keys and values: greedy answers move
    assert sync["stale_cache"]["max_abs_dlogp"] > 1e-3 and sync["stale_cache"]["bitwise_share"] < 1
    assert sync["vs_fresh"]["within_noise"] is False
    assert "Weight sync" in (out / "report.md").read_text()
    thresholds = tmp_path / "gate.toml"
    thresholds.write_text('[[checks]]\nmetric = "sync_findings"\nop = "=="\nthreshold = 0\n')
    gate = CliRunner().invoke(app, ["gate", str(out), "--thresholds", str(thresholds)])
    assert gate.exit_code == 1, gate.output
