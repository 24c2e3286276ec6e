"""What to do next (analysis/next_steps.py) and the files it writes (report/next_files.py): each finding
present and absent with its exact numbers, the sweep's axes per stack, the suggested gate's bounds
computed by hand, and the written next-sweep.toml loaded by the sweep's own reader."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from mismatch_probe.analysis import next_steps as ns
from mismatch_probe.record import RunRecord

SPEC = {
    "model": "../fixtures/models/tiny-qwen2",
    "prompts": "../fixtures/prompts/single_turn.jsonl",
    "out": "runs/one",
    "name": "one",
    "shard_size": 256,
    "max_turns": 1,
    "engine": {"name": "vllm", "dtype": "bfloat16", "logprobs_mode": "raw", "enforce_eager": True, "extra_args": {}},
    "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64, "n": 4, "seed": 0},
    "reference": {"dtype": "float32", "logits_fp32": True, "attn_implementation": "sdpa"},
    "corrections": {"token_tis": 2.0, "geo_eps": 0.001},
    "variants": [],
}


def record(**sections) -> RunRecord:
    spec = sections.pop("spec", SPEC)
    base = {
        "status": "complete",
        "spec": spec,
        "spec_file": "probes/one.toml",
        "inputs": {"model": "fixtures/models/tiny-qwen2", "prompts": "fixtures/prompts/single_turn.jsonl"},
        "environment": {"hardware": "NVIDIA H100"},
        "engine": {"engine": "vllm", "versions": {"vllm": "0.32.0"}},
        "metrics": {"k3_kl": 2e-4, "n_model_tokens": 1000, "n_zero_prob_train": 0},
        "intervals": {"level": 0.95, "n_boot": 2000, "n_sequences": 128, "metrics": {"k3_kl": [2e-4, 1.5e-4, 2.6e-4]}},
    }
    return RunRecord.model_validate(base | sections)


def steps(rec: RunRecord, precision: str | None = "bf16") -> dict[str, ns.NextStep]:
    found = ns.next_steps(
        rec, precision, run_name="one", sweep_command="S", gate_command="G", spec_command="C", precision_command="P"
    )
    return {s.topic: s for s in found}


def test_k3_above_the_published_range_asks_for_the_sweep():
    rec = record(metrics={"k3_kl": 3e-3}, intervals={"metrics": {"k3_kl": [3e-3, 2e-3, 4e-3]}})
    s = steps(rec)["K3"]
    assert s.urgent and s.command == "S" and s.writes == ns.NEXT_SWEEP
    assert s.finding == (
        "K3 0.0030 (95% interval 0.0020–0.0040) is 3.00x the top of the published range for bf16 rollouts "
        "on H20: 0.0005–0.001"
    )


@pytest.mark.parametrize(("k3", "place"), [(2e-4, "below"), (7e-4, "inside"), (1e-3, "inside")])
def test_k3_within_the_published_range_is_nothing_to_fix(k3, place):
    s = steps(record(metrics={"k3_kl": k3}, intervals=None))["K3"]
    assert not s.urgent and s.writes == ns.NEXT_SWEEP
    assert f"is {place} the published range for bf16 rollouts on H20" in s.finding


def test_k3_of_a_quantized_rollout_is_read_against_its_own_figures():
    s = steps(record(metrics={"k3_kl": 1e-2}), precision="fp8")["K3"]
    assert s.urgent and "fp8 rollouts" in s.finding and "0.0087" in s.finding  # the highest fp8 figure's top


def test_an_infinite_k3_asks_for_the_same_distribution_first():
    s = steps(record(metrics={"k3_kl": math.inf, "n_zero_prob_train": 3}))["K3"]
    assert s.urgent and "(3 tokens)" in s.finding and "logprobs_mode" in s.action


def test_decode_disagreeing_with_its_prefill_is_an_engine_problem():
    rec = record(decode_vs_prefill={"k3_kl": 1e-4, "n_model_tokens": 900})
    s = steps(rec)["decode vs prefill"]
    assert s.urgent and s.command == "C"
    assert "K3 1.000e-04, 50% of the run's K3 2.000e-04 (at or above 25%)" in s.finding
    agree = steps(record(decode_vs_prefill={"k3_kl": 1e-5, "n_model_tokens": 900}))["decode vs prefill"]
    assert not agree.urgent and "5% of the run's K3 (below 25%)" in agree.finding
    assert "decode vs prefill" not in steps(record())  # no prefill check: no line


def test_later_turns_worse_than_the_first_point_at_retokenization():
    by_turn = {"first": {"k3_kl": 1e-4, "n_model_tokens": 500}, "later": {"k3_kl": 3e-4, "n_model_tokens": 400}}
    s = steps(record(metrics_by_turn=by_turn, tokenization_check={"mismatched_turns": 2}))["later turns"]
    assert s.urgent and "3.00x the first turn's 1.000e-04 (at or above 1.5x)" in s.finding
    assert "mismatched_turns 2" in s.action
    by_turn["later"]["k3_kl"] = 1.2e-4
    fine = steps(record(metrics_by_turn=by_turn))["later turns"]
    assert not fine.urgent and "1.20x" in fine.finding
    assert "later turns" not in steps(
        record(metrics_by_turn={"first": by_turn["first"], "later": {"n_model_tokens": 0}})
    )


def corrections(**kept) -> dict:
    shares = {"token_tis_clipped_share": 0.01, "geo_rejected_share": 0.4, "seq_mis_masked_share": 0.05}
    return (
        shares
        | {ns.KEPT_K3[k]: v for k, v in kept.items()}
        | {"thresholds": {"seq_mis_masked_share": {"seq_ratio_above": 2.0}}}
    )


def test_the_correction_that_keeps_the_most_data_within_the_noise():
    # K3 3e-3 +- 20%: geo keeps 1.0e-3 (the best), seq-MIS 1.1e-3 (within 20% of it, at 5% of the data),
    # token TIS 2.5e-3 (not within)
    c = corrections(token_tis_clipped_share=2.5e-3, geo_rejected_share=1.0e-3, seq_mis_masked_share=1.1e-3)
    rec = record(metrics={"k3_kl": 3e-3}, intervals={"metrics": {"k3_kl": [3e-3, 2.4e-3, 3.6e-3]}}, corrections=c)
    s = steps(rec)["corrections"]
    assert s.urgent
    assert s.finding.startswith("sequence MIS keeps K3 0.0011 (all tokens: 0.0030) at a cost of 5% of the data")
    assert "lowest K3 any correction keeps is 0.0010" in s.finding and "±20%" in s.finding
    assert "seq_ratio_above 2" in s.action


def test_no_correction_is_needed_when_none_beats_the_noise_or_k3_is_low():
    c = corrections(token_tis_clipped_share=2.9e-3, geo_rejected_share=2.8e-3, seq_mis_masked_share=2.95e-3)
    rec = record(metrics={"k3_kl": 3e-3}, intervals={"metrics": {"k3_kl": [3e-3, 2.4e-3, 3.6e-3]}}, corrections=c)
    s = steps(rec)["corrections"]
    assert not s.urgent and s.finding.startswith("no correction lowers K3 by more than this run's noise (±20%)")
    low = record(
        corrections=corrections(token_tis_clipped_share=2e-4, geo_rejected_share=5e-5, seq_mis_masked_share=2e-4)
    )
    s = steps(low)["corrections"]
    assert not s.urgent and s.action.startswith("none needed: K3 is already at or below the top")
    assert "corrections" not in steps(record(corrections=c, intervals=None))  # no interval: no noise to judge by


def test_the_suggested_gate_is_the_estimate_plus_sqrt2_upper_half_widths():
    found = {"k3_kl": [2e-4, 1.5e-4, 2.6e-4], "prob_diff_max": [0.05, 0.02, 0.05], "chi2_token": [1.0, 0.5, 2.0]}
    rec = record(intervals={"n_boot": 2000, "n_sequences": 128, "metrics": found})
    checks = {c["metric"]: c for c in ns.suggested_checks(rec, "one")}
    assert sorted(checks) == ["k3_kl", "prob_diff_max"]  # chi2 is not a gated metric
    # 2e-4 + sqrt(2) * 0.6e-4 = 2.8485e-4, rounded up to 3 digits
    assert checks["k3_kl"]["threshold"] == 2.85e-4
    assert checks["k3_kl"]["severity"] == "fail" and checks["prob_diff_max"]["severity"] == "warn"
    assert checks["prob_diff_max"]["threshold"] == 0.05  # the maximum's interval tops at the estimate
    assert steps(rec)["gate"].writes == ns.SUGGESTED_GATE
    assert "gate" not in steps(record(intervals=None))


def test_round_up_never_goes_below():
    assert ns.round_up(0.05104) == 0.0511 and ns.round_up(0.051) == 0.051 and ns.round_up(1.00631) == 1.01
    assert ns.round_up(123456.0) == 124000.0 and ns.round_up(0.0) == 0.0


def axes(rec: RunRecord, precision: str | None = "bf16") -> dict[str, list]:
    return {a.key: a.values for a in ns.sweep_axes(rec, precision)}


def test_the_sweep_axes_follow_the_stack():
    gpu = axes(record())
    assert gpu == {
        "engine.enforce_eager": [True, False],
        "reference.logits_fp32": [True, False],
        "reference.dtype": ["float32", "bfloat16"],
        "engine.dtype": ["bfloat16", "float32"],
    }
    # cascade attention only on vLLM before 0.32, which removed it; CUDA graphs not on a CPU
    old = record(engine={"engine": "vllm", "versions": {"vllm": "0.11.2"}}, environment={"hardware": "cpu"})
    assert list(axes(old)) == ["engine.cascade_attn", "reference.logits_fp32", "reference.dtype", "engine.dtype"]
    # the log-prob mode when sampling is not plain; SGLang's own fp32 head
    spec = SPEC | {
        "engine": SPEC["engine"] | {"name": "sglang"},
        "sampling": SPEC["sampling"] | {"temperature": 0.7},
    }
    sglang = axes(record(spec=spec, engine={"engine": "sglang", "versions": {"sglang": "0.5.23"}}))
    assert sglang["engine.logprobs_mode"] == ["raw", "processed"] and sglang["engine.logits_fp32"] == [False, True]
    # a known risk of the framework's configuration comes first
    risky = record(spec=SPEC | {"stack": {"framework": "verl", "risks": [{"id": "precision-differs"}]}})
    assert next(iter(axes(risky))) == "engine.dtype"


def test_the_written_sweep_loads_and_runs_the_runs_settings(tmp_path: Path):
    """next-sweep.toml beside a run: the sweep's own reader takes it, its paths resolve from the file,
    and its baseline is the run's spec."""
    from mismatch_probe.config.spec_reading import load_spec_file
    from mismatch_probe.config.sweep import sweep_points
    from mismatch_probe.report.next_files import write_next_files

    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "runs" / "one"
    run_dir.mkdir(parents=True)
    (tmp_path / "fixtures").symlink_to(root / "fixtures")
    rec = record()
    written = write_next_files(run_dir, rec)
    assert written == [ns.NEXT_SWEEP, ns.SUGGESTED_GATE]
    text = (run_dir / ns.NEXT_SWEEP).read_text()
    parsed = tomllib.loads(text)
    assert parsed["model"] == "../../fixtures/models/tiny-qwen2" and parsed["out"] == "../one-next-sweep"
    spec = load_spec_file(run_dir / ns.NEXT_SWEEP)
    assert Path(spec.model).resolve() == (root / "fixtures/models/tiny-qwen2").resolve()
    assert spec.engine.dtype == "bfloat16" and spec.reference.logits_fp32 is True and spec.sampling.n == 4
    plan = sweep_points(spec, tmp_path / "sweep")
    assert len(plan.repeats) == 2
    assert [p.settings for p in plan.points] == [
        {"engine.enforce_eager": False},
        {"reference.logits_fp32": False},
        {"reference.dtype": "bfloat16"},
        {"engine.dtype": "float32"},
    ]
    gate = tomllib.loads((run_dir / ns.SUGGESTED_GATE).read_text())
    assert [c["metric"] for c in gate["checks"]] == ["k3_kl"]
    from mismatch_probe.config.thresholds import load_thresholds

    load_thresholds(run_dir / ns.SUGGESTED_GATE)


def test_an_infinite_k3_leaves_out_what_it_cannot_judge():
    """A sampled token the reference gives p = 0: K3, its interval and kept K3s are infinite; the K3
    line says so, and the corrections and turns lines, which would compare infinities, are left out."""
    inf = math.inf
    by_turn = {"first": {"k3_kl": inf, "n_model_tokens": 5}, "later": {"k3_kl": 1e-3, "n_model_tokens": 5}}
    c = corrections(token_tis_clipped_share=inf, geo_rejected_share=1e-3, seq_mis_masked_share=inf)
    rec = record(
        metrics={"k3_kl": inf, "n_zero_prob_train": 1},
        intervals={"metrics": {"k3_kl": [inf, 1e-3, inf]}},
        corrections=c,
        metrics_by_turn=by_turn,
    )
    found = steps(rec)
    assert found["K3"].urgent and "corrections" not in found and "later turns" not in found
    assert "gate" not in found  # no finite bound to suggest


def test_a_loose_k3_interval_asks_for_a_run_with_precision_and_its_samples():
    # (2.6e-4 - 1.5e-4) / 2 / 2e-4 = 27.5% on 128 samples: ceil(128 x 2.75^2) = 968 samples for ±10%
    s = steps(record())["sample size"]
    assert s.urgent and s.command == "P --precision 0.1"
    assert s.finding.startswith("K3's 95% interval is ±27.5% of K3 on 128 samples: a re-run")
    assert s.action.endswith("about 968 samples (7.6x this run)")
    tight = steps(record(intervals={"n_sequences": 4000, "metrics": {"k3_kl": [2e-4, 1.9e-4, 2.1e-4]}}))
    assert not tight["sample size"].urgent and "±5% of K3 on 4000 samples (within ±10%)" in tight["sample size"].finding
    assert "sample size" not in steps(record(intervals=None))


def test_a_run_with_precision_reports_its_own_outcome():
    last = {"samples_total": 768, "relative_half_width": 0.0627}
    state = {"target": 0.05, "rounds": [last], "met": False, "stop": "the budget max_samples = 768 is spent"}
    s = steps(record(precision=state | {"more_samples_needed": 441}))["sample size"]
    assert s.urgent and s.command == "P --precision 0.05 --max-samples 1209"
    assert s.finding == "K3 ±6.27% on 768 samples, short of the target ±5%: the budget max_samples = 768 is spent"
    met = steps(record(precision=state | {"met": True, "rounds": [last | {"relative_half_width": 0.048}]}))
    assert not met["sample size"].urgent and met["sample size"].finding.endswith("within the target ±5%")
    # K3 infinite: no sample count helps; the K3 line says what to do
    assert "sample size" not in steps(record(precision=state | {"more_samples_needed": None}))
