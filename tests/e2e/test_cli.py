"""`mismatch-probe` through its real entry point: a full compare on the fixture, resume, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import DENSE, MOE, ROOT, SINGLE_TURN, cli

from mismatch_probe.analysis.metrics import CANONICAL_KEYS, CORRECTION_KEYS


def record(run_dir):
    return json.loads((run_dir / "run.json").read_text())


def test_compare_writes_a_complete_run(bf16_run):
    rec = record(bf16_run)
    assert rec["status"] == "complete" and rec["schema_version"] == 4 == rec["fingerprint_schema"]
    assert {"url", "fsdp", "nnodes"} <= set(rec["spec"]["engine"]) | set(rec["spec"]["reference"])  # every setting
    assert rec["sequences"] == "sequences.parquet" and (bf16_run / "sequences.parquet").is_file()
    for key in CANONICAL_KEYS:
        assert key in rec["metrics"], key
        assert key in rec["metrics_by_turn"]["first"] and key in rec["metrics_by_turn"]["later"]
    for key in CORRECTION_KEYS:
        assert key in rec["corrections"] and key in rec["corrections"]["thresholds"]
    assert rec["metrics"]["n_sequences"] == 32 == rec["inputs"]["n_samples"]
    assert rec["metrics_by_turn"]["later"]["n_model_tokens"] == 0  # single-turn prompts
    assert rec["engine"]["dtype"] == "bfloat16" and rec["reference"]["dtype"] == "float32"
    assert rec["logprob_semantics"]["engine"]["mode"] == "raw"
    env = rec["environment"]
    assert env["packages"]["torch"] and env["packages"]["transformers"] and env["cpu_model"]
    assert env["mismatch_probe"]["version"]
    assert set(rec["timings"]) >= {"setup_s", "engine_start_s", "generation_s", "scoring_s", "metrics_s", "total_s"}
    assert len(rec["breakdowns"]["p_infer_buckets"]) == 9


def test_token_table_matches_the_record(bf16_run):
    t = pq.read_table(bf16_run / "tokens.parquet")
    rec = record(bf16_run)
    model = t.column("is_model_token").to_numpy(zero_copy_only=False)
    li = t.column("logp_infer").to_numpy(zero_copy_only=False)
    lt = t.column("logp_train").to_numpy(zero_copy_only=False)
    assert int(model.sum()) == rec["metrics"]["n_model_tokens"]
    assert np.isnan(li[~model]).all() and np.isfinite(li[model]).all() and np.isfinite(lt[model]).all()
    assert (t.column("turn").to_numpy()[~model] == -1).all() and (t.column("turn").to_numpy()[model] == 0).all()
    # every sample's tokens are contiguous and positions count up from 0
    sid, pos = t.column("sample_id").to_numpy(), t.column("position").to_numpy()
    starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
    assert len(starts) == len(np.unique(sid)) == 32
    assert (pos[starts] == 0).all()
    # k3 recomputed straight from the table, in float64
    d = lt[model].astype(np.float64) - li[model].astype(np.float64)
    assert rec["metrics"]["k3_kl"] == pytest.approx(np.mean(np.exp(d) - d - 1), rel=1e-6)


def test_bf16_engine_mismatch_is_far_above_fp32(bf16_run, tmp_path):
    out = tmp_path / "fp32"
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(out),
        "--engine-dtype",
        "float32",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "48",
        "--n",
        "2",
        "--max-prompts",
        "16",
        "--seed",
        "7",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    fp32 = json.loads(proc.stdout)["metrics"]["k3_kl"]
    bf16 = record(bf16_run)["metrics"]["k3_kl"]
    assert bf16 > 1e-6
    assert fp32 * 10 < bf16


def test_mismatch_concentrates_on_low_probability_tokens(bf16_run):
    rows = [r for r in record(bf16_run)["breakdowns"]["p_infer_buckets"] if r["count"]]
    lowest, highest = rows[0], rows[-1]
    assert highest["p_infer_lo"] == 0.99
    assert lowest["abs_delta_mean"] > 10 * highest["abs_delta_mean"]


def moe_run(tmp_path, dtype):
    proc = cli(
        "compare",
        "--model",
        str(MOE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / dtype),
        "--engine-dtype",
        dtype,
        "--train-dtype",
        "float32",
        "--max-tokens",
        "48",
        "--n",
        "2",
        "--max-prompts",
        "16",
        "--seed",
        "7",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_moe_routing_agrees_where_both_sides_compute_alike(bf16_run, tmp_path):
    # the bf16 MoE run, whose routing flips, is tests/e2e/test_routing_replay.py's (with its R3 what-if)
    assert record(bf16_run)["routing"] is None  # dense model
    rec = moe_run(tmp_path, "float32")
    fp32 = rec["routing"]
    assert fp32["set_agreement_by_layer"] == [1.0, 1.0, 1.0, 1.0] and fp32["flipped"]["n_tokens"] == 0
    replay = fp32["replay"]  # nothing flips: replaying the engine's routing changes nothing
    assert replay["k3_replayed"] == replay["k3_free"] and replay["flipped"]["n_tokens"] == 0


def test_rerun_resumes_from_the_shards(bf16_run, tmp_path):
    run = tmp_path / "resume"
    shutil.copytree(bf16_run, run)
    before = record(run)
    (run / "tokens.parquet" / "part-00000.parquet").unlink()
    spec = before["spec"]
    args = [
        "compare",
        "--model",
        spec["model"],
        "--prompts",
        spec["prompts"],
        "--out",
        str(run),
        "--engine-dtype",
        "bfloat16",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "48",
        "--n",
        "2",
        "--max-prompts",
        "16",
        "--seed",
        "7",
        "--json",
    ]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    after = json.loads(proc.stdout)
    assert "generate" not in proc.stderr  # rollouts were on disk: the engine never started
    assert after["resumed"] == {"rollout_shards_reused": 1, "token_shards_reused": 0}
    assert after["metrics"]["k3_kl"] == pytest.approx(before["metrics"]["k3_kl"], rel=1e-12)
    proc = cli(*args[:-3], "--seed", "8")
    assert proc.returncode == 2
    assert "holds a run with a different spec" in proc.stderr


def test_spec_file_with_flag_override(tmp_path):
    spec = tmp_path / "p.toml"
    spec.write_text(
        f'model = "{DENSE}"\nprompts = "{SINGLE_TURN}"\nmax_prompts = 2\n'
        '[sampling]\nmax_tokens = 8\nn = 1\n[engine]\ndtype = "bfloat16"\n'
    )
    proc = cli("compare", str(spec), "--engine-dtype", "float32", "--out", str(tmp_path / "r"), "--json")
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["engine"]["dtype"] == "float32" and rec["inputs"]["n_samples"] == 2


def test_summary_table_is_printed(bf16_run, tmp_path):
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "s"),
        "--max-prompts",
        "2",
        "--max-tokens",
        "8",
    )
    assert proc.returncode == 0, proc.stderr
    assert "K3 KL" in proc.stdout and "correction what-ifs" in proc.stdout and "run directory:" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
        (["--engine", "hff"], "unknown engine 'hff' (did you mean 'hf'?)"),
        (["--engine-dtype", "fp8"], "--engine-dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
        (["--train-dtype", "int4"], "--train-dtype must be one of float32, bfloat16, float16, got 'int4'"),
        (["--max-tokens", "5000"], "it needs"),
        (["--top-p", "1.5"], "--top-p must be <= 1, got 1.5"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path, args, message):
    base = {"--model": str(DENSE), "--prompts": str(SINGLE_TURN), "--out": str(tmp_path / "x")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    proc = cli("compare", *[x for kv in base.items() for x in kv])
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


def test_malformed_prompt_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    proc = cli("compare", "--model", str(DENSE), "--prompts", str(bad), "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "bad.jsonl:2: malformed JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    proc = cli("--debug", "compare", "--model", "/nonexistent", "--prompts", str(SINGLE_TURN))
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_engines_lists_hf():
    proc = cli("engines")
    assert proc.returncode == 0 and "hf" in proc.stdout and "yes" in proc.stdout


def test_import_is_light():
    code = (
        "import sys, mismatch_probe, mismatch_probe.cli, mismatch_probe.engines, mismatch_probe.pipeline, "
        "mismatch_probe.analysis.analyze; print(sorted(m for m in ('torch', 'vllm', 'sglang', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_error_text_with_brackets_is_printed_verbatim(tmp_path):
    """Messages carry things like mismatch-probe[vllm]; rich must not read them as markup."""
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "r"),
        "--engine",
        "vllm[cpu]",
    )
    assert proc.returncode == 2 and "unknown engine 'vllm[cpu]'" in proc.stderr
