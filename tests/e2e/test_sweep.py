"""``mismatch-probe sweep`` end to end on the fixture model with the real Hugging Face engine (its
worker process) and the real reference: engine starts per distinct engine configuration, a refused
point, paired effects against a float64 recomputation from the token tables, the gate's
recommendation and exit codes, resume after kill -9, and a recommendation by measured cost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli, token_rows

SPEC = """
name = "sweep-e2e"
model = "{model}"
prompts = "{prompts}"
max_prompts = 6

[engine]
name = "hf"
dtype = "bfloat16"

[sampling]
max_tokens = 24
n = 2

[reference]
dtype = "float32"
logits_fp32 = true

[sweep]
repeats = 2
determinism_sequences = 6
n_boot = 200

[[sweep.axes]]
key = "engine.dtype"
values = ["bfloat16", "float32"]

[[sweep.axes]]
key = "reference.dtype"
values = ["bfloat16"]

[[sweep.axes]]
key = "engine.kv_cache_dtype"   # the hf engine has no KV-cache dtype: refused
values = ["fp8"]
"""


def write_spec(directory: Path, text: str = SPEC) -> Path:
    path = directory / "sweep.toml"
    path.write_text(text.format(model=DENSE, prompts=SINGLE_TURN))
    return path


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    spec = write_spec(d)
    result = cli("sweep", str(spec), "--out", str(d / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    return d / "out", spec, result


def record(out: Path) -> dict:
    return json.loads((out / "sweep.json").read_text())


def test_one_engine_start_per_distinct_engine_configuration(swept):
    out, _, _ = swept
    rec = record(out)
    by_name = {p["name"]: p for p in rec["points"]}
    assert set(by_name) == {"baseline", "engine.dtype=float32", "reference.dtype=bfloat16", "engine.kv_cache_dtype=fp8"}
    started = {p["engine_config"] for p in rec["points"] if p["status"] == "ok"}
    assert len(started) == 2 == rec["engine_starts"]
    # each engine start is a worker process with its own log: counted from the files, not the record
    assert len(list((out / "engines").glob("*.log"))) == 2
    # the baseline's repeat and the reference-only point used the baseline's engine
    assert by_name["reference.dtype=bfloat16"]["engine_config"] == by_name["baseline"]["engine_config"]
    assert by_name["reference.dtype=bfloat16"]["rollouts_from"] == "baseline"


def test_a_setting_the_engine_cannot_run_is_refused_with_its_reason(swept):
    out, _, result = swept
    refused = next(p for p in record(out)["points"] if p["name"] == "engine.kv_cache_dtype=fp8")
    assert refused["status"] == "refused"
    assert "has no setting engine.kv_cache_dtype" in refused["reason"]
    assert "Refused: engine.kv_cache_dtype=fp8" in result.stdout
    assert "engine.kv_cache_dtype=fp8" in (out / "sweep.md").read_text()
    assert not (out / "points" / "engine.kv_cache_dtype=fp8").exists()  # no run: no directory


def k3(lt, li) -> float:
    d = np.asarray(lt, np.float64) - np.asarray(li, np.float64)
    return float(np.mean(np.expm1(d) - d))


def test_paired_effect_of_a_reference_setting_is_the_float64_recomputation(swept):
    out, _, _ = swept
    rec = record(out)
    base = token_rows(out / "points" / "baseline", model_only=True)
    point = token_rows(out / "points" / "reference.dtype=bfloat16", model_only=True)
    assert np.array_equal(base.column("token_id").to_numpy(), point.column("token_id").to_numpy())  # same tokens
    li = base.column("logp_infer").to_numpy()
    ka = k3(base.column("logp_train").to_numpy(), li)
    kb = k3(point.column("logp_train").to_numpy(), point.column("logp_infer").to_numpy())
    effect = next(p for p in rec["points"] if p["name"] == "reference.dtype=bfloat16")["delta_vs_baseline"]["k3_kl"]
    assert effect["paired"]
    assert effect["difference"][0] == pytest.approx(kb - ka, rel=1e-6)
    assert effect["ratio"][0] == pytest.approx(kb / ka, rel=1e-6)
    assert effect["difference"][1] <= effect["difference"][0] <= effect["difference"][2]


def test_bf16_engine_against_fp32_is_far_outside_the_noise_floor(swept):
    out, _, _ = swept
    rec = record(out)
    fp32 = next(p for p in rec["points"] if p["name"] == "engine.dtype=float32")
    effect = fp32["delta_vs_baseline"]["k3_kl"]
    assert not effect["paired"] and not effect["within_noise"]
    assert effect["ratio"][2] < 0.01  # an fp32 engine against an fp32 reference: K3 falls by orders of magnitude
    assert rec["noise_floor"]["runs"] == ["baseline", "baseline-repeat1"]
    assert rec["noise_floor"]["metrics"]["k3_kl"]["n_repeats"] == 2
    assert rec["attribution"]["k3_kl"][0]["name"] == "engine.dtype=float32"


def test_determinism_panel_and_reports(swept):
    out, _, _ = swept
    rec = record(out)
    det = rec["determinism"]
    assert det["n_sequences"] == 6
    assert det["prefill"]["same_batch_twice"]["bitwise_equal_share"] == 1.0  # one process, one batch: bitwise
    assert 0.0 <= det["prefill"]["alone_vs_batched"]["bitwise_equal_share"] <= 1.0
    assert det["same_seed"]["identical_tokens_share"] == 1.0
    html = (out / "sweep.html").read_text()
    for p in rec["points"]:
        if p["status"] == "ok":
            assert (out / p["run"] / "report.html").is_file()
            assert f'href="{p["run"]}/report.html"' in html
    assert "Determinism and batch invariance" in html and "Noise floor" in html
    # the effects on the headline metrics, what each correction leaves, cost vs K3
    assert html.count("data:image/svg+xml;base64,") == 3
    # each point's correction what-ifs: the share it drops -> the K3 of what it keeps
    assert "Does a correction rescue it?" in html and "% → " in html
    (out / "sweep.html").unlink()
    result = cli("report", str(out))  # the pages again, from sweep.json alone
    assert result.returncode == 0 and (out / "sweep.html").read_text().count("data:image/svg+xml;base64,") == 3


def thresholds(directory: Path, k3_max: float) -> Path:
    path = directory / f"gate-{k3_max:g}.toml"
    path.write_text(f'[[checks]]\nname = "k3"\nmetric = "k3_kl"\nop = "<="\nthreshold = {k3_max}\n')
    return path


def test_gate_names_the_change_that_passes_and_exits_by_it(swept, tmp_path):
    out, spec, _ = swept
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    # the bf16 engine fails 1e-8; the fp32 engine against the fp32 reference passes it
    result = cli("sweep", str(spec), "--out", str(copy), "--gate", str(thresholds(tmp_path, 1e-8)), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    rec = json.loads(result.stdout)
    assert rec["invocations"][-1]["engine_starts"] == 0  # every point finished earlier: nothing re-run
    assert rec["engine_starts"] == 2  # those of the first invocation
    assert rec["recommendation"]["point"] == "engine.dtype=float32"
    assert rec["recommendation"]["settings"] == {"engine.dtype": "float32"}
    assert rec["recommendation"]["evidence"]["delta_vs_baseline"]["k3_kl"]["within_noise"] is False
    gates = {p["name"]: p["gate"] for p in rec["points"]}
    assert gates["baseline"] == "FAIL" and gates["engine.dtype=float32"] == "PASS"
    # nothing passes a bound below zero: exit 1
    result = cli("sweep", str(spec), "--out", str(copy), "--gate", str(thresholds(tmp_path, -1.0)))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Recommendation: none" in result.stdout
    # baseline_factor checks compare every point with the sweep's own baseline (which passes them)
    result = cli(
        "sweep", str(spec), "--out", str(copy), "--gate", str(ROOT / "probes" / "gate-regression.toml"), "--json"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    regression = json.loads(result.stdout)
    assert regression["recommendation"]["point"] == "baseline"
    assert "ERROR" not in {p["gate"] for p in regression["points"] if p["status"] == "ok"}
    # a baseline that passes needs no change
    result = cli("sweep", str(spec), "--out", str(copy), "--gate", str(thresholds(tmp_path, 1.0)), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["recommendation"]["point"] == "baseline"


def test_another_spec_in_the_same_directory_is_refused_unless_told(swept, tmp_path):
    out, _, _ = swept
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    other = write_spec(tmp_path, SPEC.replace("max_tokens = 24", "max_tokens = 20"))
    result = cli("sweep", str(other), "--out", str(copy))
    assert result.returncode == 2 and "holds a sweep of another spec" in result.stderr


COMPARED = ("metrics", "intervals", "delta_vs_baseline", "status", "settings")


def test_killed_sweep_resumes_to_identical_results(swept, tmp_path):
    """kill -9 once the baseline has its rollouts (mid-sweep), then run again: every number of
    sweep.json is the one of the sweep that ran straight through."""
    straight, spec, _ = swept
    out = tmp_path / "out"
    exe = Path(sys.executable).with_name("mismatch-probe")
    proc = subprocess.Popen(
        [str(exe), "sweep", str(spec), "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    target = out / "points" / "baseline-repeat1" / "rollouts"
    while not (target.is_dir() and any(target.glob("part-*.parquet"))):
        assert proc.poll() is None, "the sweep finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its engine worker, at once
    proc.wait()
    assert not (out / "sweep.json").exists()
    result = cli("sweep", str(spec), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = record(straight), record(out)
    for pa, pb in zip(a["points"], b["points"], strict=True):
        for key in COMPARED:
            assert pa[key] == pb[key], (pa["name"], key)
    assert a["noise_floor"]["metrics"] == b["noise_floor"]["metrics"]
    assert len(b["invocations"]) == 1  # the killed invocation never reached its summary


class SlowWhenRouting:
    """A scripted engine: the real in-process HF engine, made slower (a fixed sleep per call) in one
    configuration, so that the cheapest passing point is known in advance."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.name = "hf"

    def generate(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_recommendation_picks_the_cheapest_passing_point(tmp_path):
    import mismatch_probe
    from mismatch_probe.engines.hf import HFEngine

    def factory(entry, model_path, engine_spec, *, log_path, trust_remote_code):
        inner = HFEngine(model_path, engine_spec, trust_remote_code=trust_remote_code)
        # record_routing does nothing for a dense model: only the scripted sleep sets the two apart
        slow = engine_spec.dtype == "float32" and engine_spec.record_routing
        # 12 s, far above what the neighbouring xdist worker's load can add to the other points' timings
        # (3 s was not: a cold CI run measured a point without the sleep costlier than the one with it)
        return SlowWhenRouting(inner, 12.0 if slow else 0.0)

    text = SPEC.split("[[sweep.axes]]")[0] + (
        'mode = "grid"\n[[sweep.axes]]\nkey = "engine.dtype"\nvalues = ["bfloat16", "float32"]\n'
        '[[sweep.axes]]\nkey = "engine.record_routing"\nvalues = [true, false]\n'
    )
    text = text.replace("repeats = 2", "repeats = 1").replace("determinism_sequences = 6", "determinism = false")
    result = mismatch_probe.sweep(
        write_spec(tmp_path, text), out=tmp_path / "out", gate=thresholds(tmp_path, 1e-8), engine_factory=factory
    )
    rec = result.record
    assert {p.name for p in rec.points} == {
        "baseline",
        "engine.record_routing=false",
        "engine.dtype=float32",
        "engine.dtype=float32+engine.record_routing=false",
    }
    assert rec.point("engine.dtype=float32").gate == "PASS"
    assert rec.point("engine.dtype=float32").cost["cost"] > 0.5  # the scripted sleep
    assert rec.recommendation["point"] == "engine.dtype=float32+engine.record_routing=false"
    assert result.exit_code == 0 and rec.engine_starts == 4
