"""Orchestration with a scripted in-process engine: crashes keep shards, resume, bad engine output.

(The worker process itself, with real engines and real crashes, is tested in test_engine_process.py.)"""

from __future__ import annotations

import json

import pytest
from conftest import DENSE, SINGLE_TURN, cli, registered, token_rows
from fake_engine import FakeEngine

from mismatch_probe import engines
from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.errors import DataError
from mismatch_probe.pipeline import compare


@pytest.fixture(autouse=True)
def fake_engine():
    FakeEngine.calls, FakeEngine.fail_on_call, FakeEngine.echo_prompt_offset = [], None, 0
    FakeEngine.logprob = -0.6931471805599453
    with registered(engines.EngineEntry("fake", "fake_engine:FakeEngine", (), "", "scripted, for tests")):
        yield


def spec(out):
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=5, shard_size=2)
    s.engine.name = "fake"
    s.reference.dtype = "float32"
    return s


def run(s, **kw):
    return compare(s, engine=FakeEngine(s.model, s.engine), **kw)


def test_engine_crash_keeps_finished_shards_and_rerun_resumes(tmp_path):
    FakeEngine.fail_on_call = 2
    with pytest.raises(RuntimeError, match="engine crashed"):
        run(spec(tmp_path / "r"))
    assert [p.name for p in (tmp_path / "r" / "rollouts").iterdir()] == ["part-00000.parquet"]
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    assert rec["status"] == "failed" and rec["error"] == "engine crashed"
    FakeEngine.calls, FakeEngine.fail_on_call = [], None
    result = run(spec(tmp_path / "r"))
    assert FakeEngine.calls == [2, 1]  # shards 1 and 2 only; shard 0 was on disk
    assert result.record["status"] == "complete"
    assert result.record["metrics"]["n_sequences"] == 5
    assert (tmp_path / "r" / "report.md").is_file()


def test_nan_logprobs_fail_after_the_table_is_written(tmp_path):
    FakeEngine.logprob = float("nan")
    with pytest.raises(DataError, match="NaN logp_infer.*kept in"):
        run(spec(tmp_path / "r"))
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    assert rec["status"] == "failed" and "NaN" in rec["error"]
    assert len(list((tmp_path / "r" / "tokens.parquet").iterdir())) == 3


def test_engine_that_changes_the_prompt_ids_is_an_error(tmp_path):
    FakeEngine.echo_prompt_offset = 1
    with pytest.raises(DataError, match="reports different token ids for turn 0.s context"):
        run(spec(tmp_path / "r"))


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    s = spec(tmp_path)
    from mismatch_probe.errors import ConfigError

    with pytest.raises(ConfigError, match="holds no run"):
        run(s, overwrite=True)
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_a_report_that_fails_to_render_keeps_the_complete_run(tmp_path, monkeypatch):
    from mismatch_probe.errors import ProbeError
    from mismatch_probe.report import figures

    def broken(record, dist):
        raise ValueError("no backend")

    monkeypatch.setattr(figures, "run_figures", broken)
    with pytest.raises(ProbeError, match="complete in .*rendering its report failed: ValueError: no backend"):
        run(spec(tmp_path / "r"))
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    assert rec["status"] == "complete" and rec["metrics"]["n_sequences"] == 5
    monkeypatch.undo()
    proc = cli("report", str(tmp_path / "r"))  # and it renders later from the directory
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r" / "report.html").is_file()


def test_rollouts_from_scores_another_runs_samples_without_an_engine(tmp_path):
    first = run(spec(tmp_path / "a")).record
    FakeEngine.calls = []
    other = spec(tmp_path / "b")
    other.reference.dtype = "bfloat16"  # a reference setting: allowed to differ
    result = compare(other, rollouts_from=tmp_path / "a")  # no engine passed, and none started
    assert FakeEngine.calls == [] and "engine_start_s" not in result.record["timings"]
    rec = result.record
    # named relative to the run directory, so the two move together without absolute paths
    assert rec["rollouts_from"] == {"run": "../a", "spec_fingerprint": first["spec_fingerprint"]}
    assert rec["engine"] == first["engine"] and rec["logprob_semantics"] == first["logprob_semantics"]
    assert rec["reference"]["dtype"] == "bfloat16"
    a, b = token_rows(tmp_path / "a"), token_rows(tmp_path / "b")
    for column in ("sample_id", "position", "token_id", "is_model_token", "logp_infer"):
        assert a.column(column).equals(b.column(column))
    assert not a.column("logp_train").equals(b.column("logp_train"))  # fp32 vs bf16 reference
    # linked, not copied, where the file system allows it
    assert (tmp_path / "b" / "rollouts" / "part-00000.parquet").stat().st_ino == (
        tmp_path / "a" / "rollouts" / "part-00000.parquet"
    ).stat().st_ino


def test_rollouts_from_refuses_other_sampling_and_unfinished_runs(tmp_path):
    from mismatch_probe.errors import ConfigError

    run(spec(tmp_path / "a"))
    other = spec(tmp_path / "b")
    other.sampling.temperature = 0.7
    with pytest.raises(ConfigError, match="another model, prompt set, engine or sampling"):
        compare(other, rollouts_from=tmp_path / "a")
    (tmp_path / "a" / "rollouts" / "part-00002.parquet").unlink()
    with pytest.raises(ConfigError, match="lacks rollout shard 2"):
        compare(spec(tmp_path / "c"), rollouts_from=tmp_path / "a")
    with pytest.raises(ConfigError, match="not a run directory"):
        compare(spec(tmp_path / "d"), rollouts_from=tmp_path)
