"""A sweep across machines, end to end with the real Hugging Face engine (its worker process) and the
real reference: split into two shard processes that run at once into one directory (a Slurm array),
a shard killed midway and run again, and each engine configuration as a Ray task on a local Ray
cluster of two nodes. Each gives the sweep.json of the sweep run in one process: every point's
metrics, intervals and effects, the noise floor, determinism, fingerprints and engine starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli

SPEC = """
name = "sweep-shards"
model = "{model}"
prompts = "{prompts}"
max_prompts = 4

[engine]
name = "hf"
dtype = "bfloat16"

[sampling]
max_tokens = 16
n = 2

[reference]
dtype = "float32"
logits_fp32 = true

[sweep]
repeats = 1
determinism_sequences = 4
n_boot = 200

[[sweep.axes]]
key = "engine.dtype"
values = ["bfloat16", "float32"]

[[sweep.axes]]
key = "reference.dtype"
values = ["bfloat16"]

[[sweep.axes]]
key = "sampling.temperature"
values = [0.7]

[[sweep.axes]]
key = "engine.kv_cache_dtype"   # refused: the hf engine has no KV-cache dtype
values = ["fp8"]
"""

# what a sweep.json must repeat, whoever ran its points; the rest is timings, and each point's cost
# (its measured throughput against the baseline's, which two runs of one sweep never measure alike)
POINT_KEYS = ("name", "status", "settings", "levels", "run", "reason", "engine_config", "rollouts_from")
POINT_KEYS += ("metrics", "intervals", "delta_vs_baseline", "corrections")
SWEEP_KEYS = ("spec_fingerprint", "mode", "repeats", "level", "engine_configs", "engine_starts", "attribution")


def same_sweep(a: dict, b: dict, *, killed: bool = False) -> None:
    """``killed``: an invocation was killed, and the engine starts it made are not counted (it never
    recorded them), nor is a start its re-run did not need (a group whose tokens were all sampled)."""
    for key in SWEEP_KEYS:
        if not (killed and key == "engine_starts"):
            assert a[key] == b[key], key
    assert a["noise_floor"]["metrics"] == b["noise_floor"]["metrics"]
    assert a["noise_floor"]["runs"] == b["noise_floor"]["runs"]
    assert a["determinism"] == b["determinism"]
    assert [p["name"] for p in a["points"]] == [p["name"] for p in b["points"]]
    for pa, pb in zip(a["points"], b["points"], strict=True):
        for key in POINT_KEYS:
            assert pa.get(key) == pb.get(key), (pa["name"], key)


# One thread in every process: a CPU forward's sums run in an order that depends on the thread count,
# and Ray runs a task of one CPU with OMP_NUM_THREADS=1, so every run here does, to give the same bits.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def record(out: Path) -> dict:
    return json.loads((out / "sweep.json").read_text())


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "sweep.toml"
    path.write_text(SPEC.format(model=DENSE, prompts=SINGLE_TURN))
    return path


@pytest.fixture(scope="module")
def serial(spec_file, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("serial") / "out"
    result = cli("sweep", str(spec_file), "--out", str(out), env=ONE_THREAD)
    assert result.returncode == 0, result.stderr[-3000:]
    rec = record(out)
    # 3 engine configurations, 2 of which start: the baseline's (with its repeat, the temperature
    # point, the reference point), fp32's, and the one the hf engine refuses (fp8 KV cache)
    assert rec["engine_configs"] == 3 and rec["engine_starts"] == 2
    assert {p["status"] for p in rec["points"]} == {"ok", "refused"}
    return rec


def shard_process(spec_file: Path, out: Path, shard: str) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("mismatch-probe")
    return subprocess.Popen(
        [str(exe), "sweep", str(spec_file), "--out", str(out), "--shard", shard],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "COLUMNS": "200", **ONE_THREAD},
    )


def wait_for_baseline_rollouts(proc: subprocess.Popen, out: Path, who: str) -> None:
    """Until the baseline's first rollout shard is on disk (mid-sweep: the moment to kill)."""
    target = out / "points" / "baseline" / "rollouts"
    deadline = time.monotonic() + 300
    while not (target.is_dir() and any(target.glob("part-*.parquet"))):
        assert proc.poll() is None, f"{who} finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_two_shards_at_once_give_the_serial_sweep(serial, spec_file, tmp_path):
    out = tmp_path / "out"
    procs = [shard_process(spec_file, out, s) for s in ("1/2", "2/2")]
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    same_sweep(serial, record(out))
    # each shard kept its own state and invocation; the engine starts add up to the serial run's
    units = sorted(p.name for p in (out / "shards").glob("*.json"))
    assert units == ["shard-1-of-2.json", "shard-2-of-2.json"]
    rec = record(out)
    assert sorted(i["unit"] for i in rec["invocations"]) == ["shard-1-of-2", "shard-2-of-2"]
    assert sum(i["engine_starts"] for i in rec["invocations"]) == 2
    assert (out / "sweep.html").is_file() and (out / "sweep.md").is_file()


def test_a_killed_shard_runs_again_to_the_serial_sweep(serial, spec_file, tmp_path):
    """Shard 1 (the baseline's engine configuration) killed with -9 once the baseline has its
    rollouts; shard 2 finishes alone and leaves the summary to come; --summarize refuses, naming what
    is missing; shard 1 run again resumes its points and writes sweep.json, the serial run's."""
    out = tmp_path / "out"
    proc = shard_process(spec_file, out, "1/2")
    wait_for_baseline_rollouts(proc, out, "shard 1")
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its engine worker, at once
    proc.communicate()

    second = cli("sweep", str(spec_file), "--out", str(out), "--shard", "2/2", env=ONE_THREAD)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "point(s) of other shards to come" in second.stdout
    assert not (out / "sweep.json").exists()

    early = cli("sweep", str(spec_file), "--out", str(out), "--summarize")
    assert early.returncode == 2
    assert "are not done: baseline" in early.stderr and "shard-2-of-2" in early.stderr

    again = cli("sweep", str(spec_file), "--out", str(out), "--shard", "1/2", env=ONE_THREAD)
    assert again.returncode == 0, again.stderr[-3000:]
    same_sweep(serial, record(out), killed=True)
    baseline = json.loads((out / "points" / "baseline" / "run.json").read_text())
    assert baseline["resumed"]["rollout_shards_reused"] >= 1  # the killed invocation's shards were kept

    # and --summarize, once all is there, writes the same again
    summary = cli("sweep", str(spec_file), "--out", str(out), "--summarize")
    assert summary.returncode == 0, summary.stderr[-3000:]
    same_sweep(serial, record(out), killed=True)


def test_bad_shards_are_refused_in_one_line(spec_file, tmp_path):
    for bad in ("0/2", "3/2", "2", "a/b"):
        result = cli("sweep", str(spec_file), "--out", str(tmp_path / "out"), "--shard", bad)
        assert result.returncode == 2 and "is not I/N" in result.stderr, result.stderr
    result = cli("sweep", str(spec_file), "--out", str(tmp_path / "o"), "--shard", "1/2", "--no-resume")
    assert result.returncode == 2 and "delete the other shards' points" in result.stderr


def test_ray_tasks_on_a_two_node_cluster_give_the_serial_sweep(serial, spec_file, tmp_path, ray_cluster):
    out = tmp_path / "out"
    result = cli(
        "sweep",
        str(spec_file),
        "--out",
        str(out),
        "--executor",
        "ray",
        "--ray-address",
        ray_cluster.address,
        env=ONE_THREAD,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    same_sweep(serial, record(out))
    rec = record(out)
    # one task per engine configuration: the two that sample, and the one whose engine refuses fp8
    keys = {p["engine_config"] for p in rec["points"] if p["engine_config"] is not None}
    assert sorted(p.stem for p in (out / "shards").glob("*.json")) == sorted(f"group-{k}" for k in keys)
    assert "submitted 3 engine configuration(s) as Ray tasks" in result.stderr


def test_a_ray_worker_killed_midway_is_retried_to_the_serial_sweep(serial, spec_file, tmp_path, ray_cluster):
    """The worker running the baseline's group is killed with -9 once the baseline has its rollouts:
    Ray runs the task again, which resumes the group from its shards on disk."""
    import psutil

    out = tmp_path / "out"
    exe = Path(sys.executable).with_name("mismatch-probe")
    args = ["sweep", str(spec_file), "--out", str(out), "--executor", "ray", "--ray-address", ray_cluster.address]
    proc = subprocess.Popen(
        [str(exe), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ONE_THREAD},
    )
    wait_for_baseline_rollouts(proc, out, "the sweep")
    # Ray names a worker's process after the task it runs (ray_executor: "mismatch-probe sweep group-<key>")
    workers = [p for p in psutil.process_iter(["cmdline"]) if "sweep group-" in " ".join(p.info["cmdline"] or [])]
    assert workers, "no Ray worker runs a group"
    for w in workers:
        for child in w.children(recursive=True):
            child.kill()  # its engine worker, which a real node loss takes with it
        w.kill()
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    same_sweep(serial, record(out), killed=True)
    baseline = json.loads((out / "points" / "baseline" / "run.json").read_text())
    assert baseline["resumed"]["rollout_shards_reused"] >= 1
