"""Adaptive sample size through the real CLI: ``compare probes/demo.toml --precision 0.1`` with vLLM
stops once K3's interval is within ±10%; with the HF engine, a run whose budget runs out says so and
how many more samples it needed, and a run killed with kill -9 mid-round resumes to the same rounds
and the same numbers as the run that went straight through."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cli, token_rows

DEMO = ROOT / "probes" / "demo.toml"
DEMO_HF = ROOT / "probes" / "demo-hf.toml"
# the HF run, small (CI runs it beside engine tests on 2 cores): 8 prompts x 4, 8 samples a shard, so a
# round has several and a kill lands inside one; ±5% with at most 192 samples, which the fixture cannot
# reach (round 1 is about ±30% on 32 samples): the budget stops it
HF_ARGS = (
    "--max-prompts",
    "8",
    "--max-tokens",
    "16",
    "--shard-size",
    "8",
    "--precision",
    "0.05",
    "--max-samples",
    "192",
)
HF_FIRST_ROUND_SHARDS = 32 // 8


def _record(run):
    return json.loads((run / "run.json").read_text())


def _check_rounds(rec: dict) -> None:
    """What holds of any adaptive run: the rounds add up to the run's samples and shards, each
    grows at most 3x, each but the last missed the target, the run's own interval is the last round's."""
    precision, inputs = rec["precision"], rec["inputs"]
    rounds = precision["rounds"]
    assert [r["samples"] for r in rounds] == inputs["round_samples"] and precision["next_round"] is None
    assert sum(inputs["round_samples"]) == inputs["n_samples"] == rounds[-1]["samples_total"]
    assert sum(r["shards"] for r in rounds) == inputs["n_shards"]
    for before, r in itertools.pairwise(rounds):
        assert r["samples"] <= 3 * before["samples_total"] and r["samples"] % rec["spec"]["sampling"]["n"] == 0
        assert not before["met"] and before["relative_half_width"] > precision["target"]
    last = rounds[-1]
    assert last["tokens_total"] == rec["metrics"]["n_model_tokens"]
    if rec.get("rollouts_from"):  # re-scored: the rounds, and their K3, are the sampling run's
        return
    assert rec["intervals"]["metrics"]["k3_kl"] == pytest.approx([last["k3_kl"], last["low"], last["high"]], rel=1e-12)
    assert rec["metrics"]["k3_kl"] == pytest.approx(last["k3_kl"], rel=1e-12)


@pytest.mark.vllm
def test_compare_demo_with_precision_stops_within_ten_percent_or_says_it_could_not(tmp_path):
    """The issue's words: it stops within ±10% or says it could not. Which one depends on the CPU's
    kernels: on this AVX-512 machine round 1 is about ±15% and the target is met in 2-3 rounds; the
    committed example, sampled with AMX, is ±37.7% on 128 samples, which would need about 1,800, more
    than the default budget of 1,280 (the test then checks the other branch)."""
    out = tmp_path / "run"
    proc = cli("compare", str(DEMO), "--precision", "0.1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = _record(out)
    _check_rounds(rec)
    precision, said = rec["precision"], proc.stdout.replace("\n", " ")
    last = precision["rounds"][-1]
    if precision["met"]:
        assert precision["stop"] is None and last["relative_half_width"] <= 0.1
        assert "precision met: K3" in said
    else:
        assert precision["stop"] == "the budget max_samples = 1280 is spent" and last["relative_half_width"] > 0.1
        assert precision["more_samples_needed"] > 0 and "precision not met: K3" in said
    assert "## Sample size" in (out / "report.md").read_text()
    assert (out / "figures" / "precision_rounds.svg").is_file()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The HF run, straight through."""
    out = tmp_path_factory.mktemp("adaptive") / "straight"
    proc = cli("compare", str(DEMO_HF), *HF_ARGS, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_a_spent_budget_says_not_met_and_how_many_more_samples(straight):
    out, proc = straight
    rec = _record(out)
    _check_rounds(rec)
    precision = rec["precision"]
    assert precision["met"] is False and precision["stop"] == "the budget max_samples = 192 is spent"
    assert rec["inputs"]["n_samples"] == 192 and len(precision["rounds"]) >= 2
    assert precision["more_samples_needed"] == precision["samples_needed"] - 192 > 0
    said = f"{precision['more_samples_needed']} more samples estimated"
    assert said in proc.stdout.replace("\n", " ") and said in (out / "report.md").read_text()


def test_a_run_killed_mid_round_resumes_to_the_same_rounds_and_numbers(straight, tmp_path):
    out, _ = straight
    killed = tmp_path / "killed"
    exe = Path(sys.executable).with_name("mismatch-probe")
    proc = subprocess.Popen(
        [str(exe), "compare", str(DEMO_HF), *HF_ARGS, "--out", str(killed)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # the second round's second shard sampled: round 1 is decided and round 2 half done
    target = killed / "rollouts" / f"part-{HF_FIRST_ROUND_SHARDS + 1:05d}.parquet"
    deadline = time.monotonic() + 300
    while not target.is_file():
        assert proc.poll() is None, "the run finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its engine worker, at once
    proc.wait()
    stopped = _record(killed)
    assert stopped["status"] == "running" and len(stopped["precision"]["rounds"]) == 1
    resumed = cli("compare", str(DEMO_HF), *HF_ARGS, "--out", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _record(out), _record(killed)
    drop = ("seconds_total",)  # the one thing a kill changes: the clock
    assert [{k: v for k, v in r.items() if k not in drop} for r in a["precision"]["rounds"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in b["precision"]["rounds"]
    ]
    assert a["metrics"] == b["metrics"] and a["inputs"]["round_samples"] == b["inputs"]["round_samples"]
    ta, tb = token_rows(out), token_rows(killed)
    for column in ("sample_id", "token_id", "logp_infer", "logp_train"):
        x, y = ta.column(column).to_numpy(), tb.column(column).to_numpy()
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), column  # NaN: a prompt token
    # the shards of the rounds the killed invocation sampled were kept, not sampled again
    assert b["resumed"]["rollout_shards_reused"] >= HF_FIRST_ROUND_SHARDS + 2


def test_score_and_analyze_open_an_adaptive_run_from_its_directory(straight, tmp_path):
    """The later stages rebuild the rounds' shards from run.json alone (inputs.round_samples)."""
    out, _ = straight
    again = cli("analyze", str(out))
    assert again.returncode == 0, again.stderr[-3000:]
    rec = _record(out)
    _check_rounds(rec)
    rescored = tmp_path / "rescored"
    proc = cli("score", str(out), "--out", str(rescored), "--train-dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _record(rescored)["inputs"]["round_samples"] == rec["inputs"]["round_samples"]
    assert token_rows(rescored).num_rows == token_rows(out).num_rows


SWEEP = """
name = "sweep-adaptive"
model = "{root}/fixtures/models/tiny-qwen2"
prompts = "{root}/fixtures/prompts/single_turn.jsonl"
max_prompts = 8

[engine]
name = "hf"
dtype = "bfloat16"

[sampling]
max_tokens = 16
n = 4
precision = 0.25
max_samples = 1024  # room for a CPU whose kernels give a wider first round than this one's

[reference]
dtype = "float32"
logits_fp32 = true

[sweep]
repeats = 2

[[sweep.axes]]
key = "engine.dtype"
values = ["bfloat16", "float32"]

[[sweep.axes]]
key = "reference.logits_fp32"
values = [true, false]
"""


def test_a_sweep_samples_each_point_in_rounds_and_a_rescored_point_takes_its_sources(tmp_path):
    spec = tmp_path / "sweep.toml"
    spec.write_text(SWEEP.format(root=ROOT))
    out = tmp_path / "out"
    proc = cli("sweep", str(spec), "--out", str(out))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a finding outside the noise, not a failure
    sweep = json.loads((out / "sweep.json").read_text())
    assert all(p["status"] == "ok" for p in sweep["points"]), [(p["name"], p.get("reason")) for p in sweep["points"]]
    points = {p.name: _record(p) for p in (out / "points").iterdir()}
    assert set(points) == {"baseline", "baseline-repeat1", "engine.dtype=float32", "reference.logits_fp32=false"}
    for name, rec in points.items():
        _check_rounds(rec)
        assert rec["precision"]["met"] is True, name  # the fixture reaches ±25% well within 1,024 samples
    rescored = points["reference.logits_fp32=false"]
    assert rescored["rollouts_from"]["run"] == "../baseline"
    assert rescored["inputs"]["round_samples"] == points["baseline"]["inputs"]["round_samples"]
    assert rescored["precision"] == points["baseline"]["precision"]
