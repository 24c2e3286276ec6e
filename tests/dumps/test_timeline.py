"""``mismatch-probe timeline`` on 200-step synthetic runs in every dump format, with drift injected
at a known step (synthetic_run.py): the change is found where it was put, every format's rows equal
the generic format's, the stationary twin raises no alarm, a killed import resumes to the same
steps.parquet, new steps of a live run are picked up alone, and the gate checks every step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from required import unavailable
from synthetic_run import FORMATS, synthetic_run, write_run
from training_run import verl_site

from mismatch_probe.timeline.runner import TimelineOptions, build_timeline

DRIFT_AT, STEPS = 121, 200
OTHER_ORDER = ("prime-rl",)  # formats that list a step's samples in another order than the generic one
WINDOW = 5  # the change step found within this many steps of the truth


def _require(fmt: str) -> None:
    if fmt == "verl" and verl_site() is None:
        unavailable("VERL", "verl is not installed for the tests: bash tests/dumps/install-verl.sh .verl-site")


def _options(fmt: str, source: Path, out: Path, **kw) -> TimelineOptions:
    return TimelineOptions(format=fmt, source=str(source), out=str(out), trust_pickle=fmt == "verl", keep="none", **kw)


@pytest.fixture(scope="module")
def drifting():
    return synthetic_run(STEPS, drift_at=DRIFT_AT, factor=3.0, seed=1)


@pytest.fixture(scope="module")
def stationary():
    return synthetic_run(STEPS, seed=1)


@pytest.fixture(scope="module")
def generic_drift(drifting, tmp_path_factory):
    """The drifting run's timeline from the generic format (in the process pool): the rows every
    other format's timeline must equal, and the timeline the gate reads."""
    d = tmp_path_factory.mktemp("generic-drift")
    found = build_timeline(_options("generic", write_run("generic", drifting, d / "dump"), d / "t", workers=2))
    return found, d / "t"


def _value_columns(path: Path) -> dict[str, np.ndarray]:
    table = pq.read_table(path / "steps.parquet")
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


@pytest.mark.parametrize("fmt", FORMATS)
def test_drift_is_found_where_it_was_injected_in_every_format(fmt, drifting, generic_drift, tmp_path):
    _require(fmt)
    if fmt == "generic":
        found, out = generic_drift
    else:
        out = tmp_path / "t"
        found = build_timeline(_options(fmt, write_run(fmt, drifting, tmp_path / "drift"), out, workers=1))
    k3 = found.record.drift["k3_kl"]
    assert found.record.steps["count"] == STEPS and not found.failed
    assert k3["detected"], k3
    assert abs(k3["change_step"] - DRIFT_AT) <= WINDOW, k3
    low, high = k3["interval"]
    assert low <= DRIFT_AT <= high, k3
    assert k3["alarm_step"] - DRIFT_AT <= 10, k3  # a live monitor would have said so within a few steps
    assert 2.0 < k3["ratio"] < 4.5, k3  # the variance tripled: K3 about 3x
    # the same synthetic steps give the same rows whichever framework's layout carried them (to
    # float32 rounding: some formats store log-probs as float32), so the stationary twin's verdict,
    # tested in the generic format, holds for each. prime-rl lists a step's samples rank by rank,
    # so its bootstrap resamples them in another order: its values equal, its intervals are other
    # draws, and its own stationary twin is tested
    got, want = _value_columns(out), _value_columns(generic_drift[1])
    assert list(got) == list(want) and got["step"].tolist() == want["step"].tolist()
    for name, values in want.items():
        if values.dtype.kind != "f":
            assert got[name].tolist() == values.tolist(), name
        elif not (fmt in OTHER_ORDER and name.endswith(("_low", "_high"))):
            np.testing.assert_allclose(got[name], values, rtol=1e-5, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("fmt", ["generic", *OTHER_ORDER])
def test_the_stationary_twin_raises_no_alarm_and_its_k3_is_the_definitions(fmt, stationary, tmp_path):
    calm = build_timeline(_options(fmt, write_run(fmt, stationary, tmp_path / "calm"), tmp_path / "t2"))
    assert not calm.record.drift["k3_kl"]["detected"], calm.record.drift["k3_kl"]
    rows = pq.read_table(tmp_path / "t2" / "steps.parquet")
    assert rows.num_rows == 3 * STEPS  # all, first and later turns: every other sequence calls a tool
    expected_k3 = [_k3(step) for step in stationary.values()]
    got = rows.filter(rows.column("group").to_numpy(zero_copy_only=False) == "all").column("k3_kl").to_numpy()
    np.testing.assert_allclose(got, expected_k3, rtol=1e-6)


def _k3(step) -> float:
    """K3 of a step in float64, by its definition (r - 1 - log r, r = p_train / p_infer)."""
    li, lt = step.model_arrays()
    delta = lt - li
    return float(np.mean(np.expm1(delta) - delta))


def test_steps_as_ray_tasks_on_a_two_node_cluster_give_the_same_steps(drifting, generic_drift, tmp_path, ray_cluster):
    """The drifting run's generic timeline with each step a Ray task (a head and a worker node on
    this machine): steps.parquet is the process pool's, bit for bit, and so is every drift verdict."""
    source = write_run("generic", drifting, tmp_path / "dump")
    found = build_timeline(_options("generic", source, tmp_path / "t", executor="ray", ray_address=ray_cluster.address))
    assert len(found.analysed) == STEPS and not found.failed
    assert pq.read_table(tmp_path / "t" / "steps.parquet").equals(pq.read_table(generic_drift[1] / "steps.parquet"))
    assert found.record.drift == generic_drift[0].record.drift
    assert found.record.options["executor"] == "ray"


def test_a_killed_import_resumes_to_the_same_steps_and_keeps_the_finished_ones(drifting, tmp_path):
    source = write_run("generic", drifting, tmp_path / "dump")
    whole = build_timeline(_options("generic", source, tmp_path / "whole", workers=1))
    assert len(whole.analysed) == STEPS
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "mismatch_probe", "timeline", str(source), "--format", "generic", "--out", str(out)]
    cmd += ["--workers", "1", "--keep", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    parts = out / "steps"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(parts.glob("step-*.parquet"))) < 40:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in parts.glob("step-*.parquet")}
    assert 40 <= len(finished) < STEPS, "the kill came too late to test a resume"
    resumed = build_timeline(_options("generic", source, out, workers=1))
    assert len(resumed.analysed) == STEPS - len(finished)
    for name, (mtime, data) in finished.items():
        assert (parts / name).stat().st_mtime_ns == mtime and (parts / name).read_bytes() == data
    assert (out / "steps.parquet").read_bytes() == (tmp_path / "whole" / "steps.parquet").read_bytes()


def test_a_live_run_is_followed_and_a_rerun_analyses_only_new_steps(tmp_path):
    steps = synthetic_run(30, seed=3)
    source = tmp_path / "live"
    early = {k: v for k, v in steps.items() if k <= 20}
    write_run("generic", early, source)
    first = build_timeline(_options("generic", source, tmp_path / "t", workers=1))
    assert first.analysed == list(range(1, 21))

    # the trainer goes on: ten more steps, one every 0.2 s (idle_exit_s leaves room for a loaded CI
    # machine that stalls the writer)
    def writer():
        for k in range(21, 31):
            write_run("generic", {k: steps[k]}, source)
            time.sleep(0.2)

    thread = threading.Thread(target=writer)
    thread.start()
    followed = build_timeline(
        _options("generic", source, tmp_path / "t", workers=1, follow=True, poll_s=0.2, settle_s=0.3, idle_exit_s=5.0)
    )
    thread.join()
    assert followed.analysed == list(range(21, 31))
    assert followed.record.status == "complete" and followed.record.steps["count"] == 30
    again = build_timeline(_options("generic", source, tmp_path / "t", workers=1))
    assert again.analysed == []


def test_the_gate_checks_every_step_and_growth_against_the_first_steps(generic_drift, tmp_path):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    timeline = generic_drift[1]
    thresholds = tmp_path / "growth.toml"
    thresholds.write_text(
        '[[checks]]\nname = "k3-growth"\nmetric = "k3_kl"\nop = "<="\nbaseline_factor = 2.0\n\n'
        '[[checks]]\nname = "k3-cap"\nmetric = "k3_kl"\nop = "<="\nthreshold = 1.0\n'
    )
    junit = tmp_path / "gate.xml"
    result = CliRunner().invoke(app, ["gate", str(timeline), "--thresholds", str(thresholds), "--junit", str(junit)])
    assert result.exit_code == 1, result.output
    from junitparser import JUnitXml

    cases = [case for suite in JUnitXml.fromfile(str(junit)) for case in suite]
    assert len(cases) == 2 * STEPS
    failed = sorted(int(c.name.rsplit(" ", 1)[1]) for c in cases if c.name.startswith("k3-growth") and not c.is_passed)
    assert failed and min(failed) >= DRIFT_AT - WINDOW  # growth is flagged after the drift, not before
    assert len([s for s in failed if s >= DRIFT_AT]) >= 0.9 * (STEPS - DRIFT_AT + 1)
    assert all(c.is_passed for c in cases if c.name.startswith("k3-cap"))
