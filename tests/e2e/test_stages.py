"""``sample``, ``score`` and ``analyze`` as separate commands, through the real CLI with the HF
engine: together they give exactly what ``compare`` gives; ``score --out`` re-scores the same
rollouts with another reference; each stage refuses, in one line and exit 2, an input it cannot use."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import ROOT, cli, token_rows

from mismatch_probe.files import relative_to_dir

SPEC = ROOT / "probes" / "demo-hf.toml"
SMALL = ("--set", "max_prompts=4", "--set", "sampling.max_tokens=16")


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    d = tmp_path_factory.mktemp("stages")
    run = d / "run"
    result = cli("sample", str(SPEC), "--out", str(run), *SMALL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"next: mismatch-probe score {run}" in result.stdout.replace("\n", "")
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "running" and rec["engine"] and not (run / "tokens.parquet").exists()
    refused = cli("analyze", str(run))  # nothing scored yet
    assert refused.returncode == 2 and "0 of 1 scored token shards" in refused.stderr
    for args in (("score", str(run)), ("analyze", str(run))):
        result = cli(*args)
        assert result.returncode == 0, result.stderr[-2000:]
    return d, run


def test_sample_score_analyze_is_exactly_compare(staged):
    d, run = staged
    whole = d / "compare"
    spec = d / "small.toml"  # the demo spec with what sample's --set changed, for compare
    text = SPEC.read_text().replace('out = "../reports/demo-hf"', "max_prompts = 4")
    spec.write_text(text.replace("max_tokens = 64", "max_tokens = 16").replace('"../', f'"{ROOT}/'))
    result = cli("compare", str(spec), "--out", str(whole))
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = token_rows(run), token_rows(whole)
    for column in ("sample_id", "token_id", "logp_infer", "logp_train", "logp_prefill"):
        x, y = a.column(column).to_numpy(), b.column(column).to_numpy()
        assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), column
    ra, rb = json.loads((run / "run.json").read_text()), json.loads((whole / "run.json").read_text())
    assert ra["status"] == rb["status"] == "complete"
    assert ra["metrics"] == rb["metrics"]
    assert (run / "report.html").is_file() and (run / "sequences.parquet").is_file()


# the same setting as --set, or as its flag (score's [reference] / [corrections] flags are the spec's)
@pytest.mark.parametrize(
    "setting",
    [("--set", "reference.dtype=bfloat16"), ("--train-dtype", "bfloat16", "--token-tis", "3")],
    ids=["set", "flags"],
)
def test_score_out_rescores_the_same_rollouts_with_another_reference(staged, tmp_path, setting):
    _, run = staged
    other = tmp_path / "bf16"
    result = cli("score", str(run), "--out", str(other), *setting)
    assert result.returncode == 0, result.stderr[-2000:]
    assert cli("analyze", str(other)).returncode == 0
    rec = json.loads((other / "run.json").read_text())
    assert rec["spec"]["reference"]["dtype"] == "bfloat16" and rec["reference"]["dtype"] == "bfloat16"
    if "--token-tis" in setting:
        assert rec["spec"]["corrections"]["token_tis"] == 3 and rec["corrections"]["thresholds"][
            "token_tis_clipped_share"
        ] == {"ratio_above": 3}
    assert rec["rollouts_from"]["run"] == relative_to_dir(run, other)
    a, b = token_rows(run, model_only=True), token_rows(other, model_only=True)
    assert np.array_equal(a.column("token_id").to_numpy(), b.column("token_id").to_numpy())
    assert np.array_equal(a.column("logp_infer").to_numpy(), b.column("logp_infer").to_numpy())
    assert not np.array_equal(a.column("logp_train").to_numpy(), b.column("logp_train").to_numpy())
    # the rollout shards are the same files (hard links), not copies
    assert (other / "rollouts" / "part-00000.parquet").stat().st_ino == (
        run / "rollouts" / "part-00000.parquet"
    ).stat().st_ino


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "reference.dtype=bfloat16"), "add --out NEW_DIR"),
        (("--train-dtype", "bfloat16"), "add --out NEW_DIR"),
        (("--out", "X", "--train-dtype", "fp33"), "--train-dtype must be one of float32, bfloat16"),
        (("--out", "X", "--set", "engine.dtype=float32"), "only [reference] and [corrections]"),
        (("--out", "X", "--set", "reference.dtype"), "is not KEY=VALUE"),
        (("--out", "X", "--set", "reference.dtype=fp33"), "--set reference.dtype must be one of float32, bfloat16"),
        (
            ("--out", "X", "--set", "reference.tensor_parallel_size=3"),
            "divides 4 and 2",
        ),  # checked before a rank starts
    ],
)
def test_score_refuses_what_cannot_score_the_same_rollouts(staged, tmp_path, args, message):
    _, run = staged
    args = tuple(str(tmp_path / "x") if a == "X" else a for a in args)
    result = cli("score", str(run), *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "x").exists()


def test_stages_refuse_a_directory_that_is_not_a_finished_earlier_stage(staged, tmp_path):
    _, run = staged
    assert cli("score", str(tmp_path)).returncode == 2  # no run.json
    half = tmp_path / "half"
    shutil.copytree(run, half)
    (half / "rollouts" / "part-00000.parquet").unlink()
    result = cli("score", str(half))
    assert (
        result.returncode == 2 and "0 of 1 rollout shards" in result.stderr and "mismatch-probe sample" in result.stderr
    )


def test_score_elsewhere_finds_the_checkpoint_with_model(staged, tmp_path):
    """A run sampled here, scored from another working directory: the recorded checkpoint path is
    relative to where it was sampled, so --model names it."""
    _, run = staged
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    shutil.rmtree(moved / "tokens.parquet")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lost = cli("score", str(moved), cwd=elsewhere)
    assert lost.returncode == 2 and "--model" in lost.stderr, lost.stderr
    found = cli("score", str(moved), "--model", str(ROOT / "fixtures" / "models" / "tiny-qwen2"), cwd=elsewhere)
    assert found.returncode == 0, found.stderr[-2000:]
    a, b = token_rows(moved, model_only=True), token_rows(run, model_only=True)
    assert np.array_equal(a.column("logp_train").to_numpy(), b.column("logp_train").to_numpy())
