"""The engine worker process for real: bit-exact transport, crashes, engine errors, --engine-python."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
from conftest import DENSE, SINGLE_TURN, cli, registered

from mismatch_probe import engines
from mismatch_probe.config.spec import EngineSpec, ProbeSpec, SamplingSpec
from mismatch_probe.engines import GenerationRequest, ScoreRequest, get_entry
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.errors import ConfigError, EngineError
from mismatch_probe.pipeline import compare

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where scripted_engines.py is


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """Register the scripted engines; the worker finds them through PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MISMATCH_PROBE_TEST_CALLS", str(tmp_path / "calls"))
    names = ("DiesOnSecondShard", "RaisesOnGenerate", "RefusesSetting", "KilledOnGenerate")
    with registered(*(engines.EngineEntry(name, f"scripted_engines:{name}", (), "", "test") for name in names)):
        yield


def spec(out, engine="hf", **engine_settings):
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=6, shard_size=3)
    s.engine = EngineSpec(name=engine, **engine_settings)
    s.sampling = SamplingSpec(temperature=1.0, max_tokens=16, seed=3)
    s.reference.dtype = "float32"
    return s


def test_worker_returns_exactly_what_the_engine_computed(tmp_path):
    """The same seeded HF engine in-process and behind the worker gives bit-identical samples."""
    from mismatch_probe.engines.hf import HFEngine

    es = EngineSpec(dtype="float32", batch_size=4)
    sampling = SamplingSpec(temperature=1.0, max_tokens=12)
    rng = np.random.default_rng(0)
    requests = [GenerationRequest(rng.integers(3, 300, size=k).astype(np.int32), 12) for k in (5, 9, 3, 7, 4)]
    local = HFEngine(DENSE, es)
    expected = local.generate(requests, sampling, stop_token_ids=[2], seed=11)
    expected_prefill = local.prefill_logprobs(
        [
            ScoreRequest(np.concatenate([r.prompt_token_ids, c.token_ids]), len(r.prompt_token_ids))
            for r, c in zip(requests, expected)
        ]
    )
    local.close()

    progress = []
    worker = EngineProcess(get_entry("hf"), DENSE, es, log_path=tmp_path / "engine.log")
    try:
        got = worker.generate(requests, sampling, stop_token_ids=[2], seed=11, on_progress=progress.append)
        got_prefill = worker.prefill_logprobs(
            [
                ScoreRequest(np.concatenate([r.prompt_token_ids, c.token_ids]), len(r.prompt_token_ids))
                for r, c in zip(requests, got)
            ]
        )
        assert worker.info()["dtype"] == "float32"
        assert worker.semantics(sampling).mode == "raw"
    finally:
        worker.close()
    assert sum(progress) == len(requests)
    for e, g in zip(expected, got):
        assert np.array_equal(e.token_ids, g.token_ids) and e.token_ids.dtype == g.token_ids.dtype
        assert np.array_equal(e.logprobs, g.logprobs) and e.finish_reason == g.finish_reason
    for e, g in zip(expected_prefill, got_prefill):
        assert np.array_equal(e, g)
    assert worker.proc.poll() is not None and worker.exit_code == 0  # closed: the process is gone
    assert worker.describe()["peak_rss_mib"] > 0


def test_prefill_matches_decode_for_an_fp32_engine(tmp_path):
    """fp32 decode with a KV cache and an fp32 full-sequence prefill agree to float rounding."""
    from mismatch_probe.engines.hf import HFEngine

    eng = HFEngine(DENSE, EngineSpec(dtype="float32", batch_size=3))
    reqs = [GenerationRequest(np.array([1, 40, 50, 60 + k], np.int32), 10) for k in range(3)]
    done = eng.generate(reqs, SamplingSpec(temperature=1.0, max_tokens=10), stop_token_ids=[2], seed=0)
    pre = eng.prefill_logprobs(
        [ScoreRequest(np.concatenate([r.prompt_token_ids, c.token_ids]), 4) for r, c in zip(reqs, done)]
    )
    eng.close()
    for c, p in zip(done, pre):
        assert len(p) == len(c.token_ids)
        np.testing.assert_allclose(p, c.logprobs, atol=2e-5)


def test_a_dying_worker_reports_the_engines_last_words_and_keeps_shards(tmp_path, scripted):
    out = tmp_path / "r"
    with pytest.raises(EngineError) as info:
        compare(spec(out, "DiesOnSecondShard"))
    msg = str(info.value)
    assert "died during generate (exit code 3)" in msg
    assert "CUDA error: an illegal memory access" in msg and "engine.log" in msg
    assert [p.name for p in (out / "rollouts").iterdir()] == ["part-00000.parquet"]
    rec = json.loads((out / "run.json").read_text())
    assert rec["status"] == "failed" and "illegal memory access" in rec["error"]
    # the same command again resumes: shard 0 is reused, the engine is not asked for it again
    result = compare(spec(out, "DiesOnSecondShard"))
    assert result.record["status"] == "complete" and result.record["resumed"]["rollout_shards_reused"] == 1
    assert result.record["metrics"]["n_sequences"] == 6


def test_an_engine_exception_arrives_with_its_own_message(tmp_path, scripted):
    with pytest.raises(EngineError, match="failed during generate: ValueError: max_num_batched_tokens"):
        compare(spec(tmp_path / "r", "RaisesOnGenerate"))


def test_a_killed_worker_is_named_as_such(tmp_path, scripted):
    with pytest.raises(EngineError, match=r"died during generate \(killed by SIGKILL \(out of memory\?\)\)"):
        compare(spec(tmp_path / "r", "KilledOnGenerate"))
    assert _worker_children() == []


def _worker_children() -> list[str]:
    """Command lines of this process's children that are engine workers."""
    pids = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            pids += f.read().split()
    cmds = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmds.append(f.read().replace(b"\0", b" ").decode())
        except FileNotFoundError:
            pass
    return [c for c in cmds if "mismatch_probe.engines.worker" in c]


def test_an_adapter_config_error_stays_a_config_error_and_the_worker_is_gone(tmp_path, scripted):
    with pytest.raises(ConfigError, match="no such kernel") as info:
        compare(spec(tmp_path / "r", "RefusesSetting"))
    assert info.value.hint == "drop the flag"
    assert _worker_children() == []


def test_engine_python_runs_the_worker_under_that_interpreter(tmp_path):
    marker = tmp_path / "used"
    wrapper = tmp_path / "bin" / "python"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {marker}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "r"),
        "--max-prompts",
        "2",
        "--max-tokens",
        "8",
        "--engine-python",
        str(wrapper),
    )
    assert proc.returncode == 0, proc.stderr
    assert "mismatch_probe.engines.worker" in marker.read_text()
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    assert rec["spec"]["engine"]["python"] == str(wrapper)
    assert rec["engine_process"]["exit_code"] == 0


def test_engine_python_without_mismatch_probe_says_how_to_fix_it(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "r"),
        "--max-prompts",
        "1",
        "--engine-python",
        str(tmp_path / "bare" / "bin" / "python"),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    err = " ".join(proc.stderr.split())
    assert "cannot run the engine worker" in err and "No module named 'mismatch_probe'" in err
    assert "pip install" in err


def test_a_setting_the_engine_does_not_have_is_refused(tmp_path):
    proc = cli(
        "compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(tmp_path / "r"), "--tp", "2"
    )
    assert proc.returncode == 2
    assert "engine 'hf' has no setting engine.tensor_parallel_size (--tp)" in proc.stderr
    assert "it applies to: sglang, vllm" in proc.stderr


def test_the_engine_cores_root_cause_is_found_in_its_log(tmp_path):
    """vLLM's own exception says 'see root cause above'; the cause is a prefixed line in the log."""
    from mismatch_probe.engines.process import log_errors

    log = tmp_path / "engine.log"
    log.write_text(
        "(EngineCore pid=7) INFO 11-22 06:24:20 [core.py:1] starting\n"
        "(VllmWorker-0 pid=9) ERROR 11-22 06:24:22 [multiproc_executor.py:953]     raise ValueError(\n"
        "(VllmWorker-0 pid=9) ERROR 11-22 06:24:22 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (14.69/16.34 GiB) on startup is less than desired CPU memory utilization (0.92, 15.03 GiB).\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    found = log_errors(log, exclude="Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    assert found == [
        (
            "ValueError: Available memory on node 0 (14.69/16.34 GiB) on startup is less than desired "
            "CPU memory utilization (0.92, 15.03 GiB)."
        )
    ]
