"""Your dashboard (analysis/peer_metrics.py): every framework's metric against a float64 derivation
written here from the framework's own code (loops over sequences, as the frameworks' masks and
reductions read), on random runs and on the edges: one-token sequences, equal log-probs, ratios past
the frameworks' clamps and thresholds, a run streamed in several shards."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_probe.analysis import peer_metrics as pm
from mismatch_probe.config.spec import CorrectionThresholds

# every threshold distinct, so a metric that reads the wrong one fails (the defaults share 2.0)
TH = CorrectionThresholds(token_tis=2.5, token_mask_low=0.4, token_mask_high=2.2, seq_tis=2.8, seq_mis=3.0)


def run(seed: int, n_seq: int = 40, extreme: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Sequences of (logp_train, logp_infer): 1 to 60 tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_seq):
        n = 1 if i % 7 == 0 else int(rng.integers(2, 60))
        li = -rng.exponential(0.8, n)
        lt = np.minimum(li + rng.normal(0, 0.15, n), 0.0)
        if i % 11 == 3:
            lt = li.copy()  # the two sides agree exactly
        if extreme and i % 5 == 1:
            lt[0] = li[0] + 25.0 if li[0] + 25.0 < 0 else -1e-3  # past the ±20 clamp
            li[-1] = -30.0  # r = p_train / p_infer far above every threshold
        out.append((lt, li))
    return out


def accumulate(seqs, shards: int = 3) -> pm.PeerStats:
    acc = pm.PeerAccumulator(TH)
    for part in np.array_split(np.arange(len(seqs)), shards):
        if not len(part):
            continue
        lt = np.concatenate([seqs[i][0] for i in part])
        li = np.concatenate([seqs[i][1] for i in part])
        lengths = [len(seqs[i][0]) for i in part]
        acc.add(lt, li, np.cumsum([0, *lengths[:-1]]))
    return acc.stats()


def expected(seqs, th: CorrectionThresholds = TH) -> dict[str, dict[str, float]]:
    """Each framework's metric, straight from its code's formula, in float64."""
    tok_t = np.concatenate([s[0] for s in seqs])
    tok_i = np.concatenate([s[1] for s in seqs])
    d = tok_t - tok_i
    with np.errstate(over="ignore"):
        r = np.exp(d)
    k3 = r - d - 1
    pt, pi = np.exp(tok_t), np.exp(tok_i)
    mean_t = np.array([s[0].mean() for s in seqs])
    mean_i = np.array([s[1].mean() for s in seqs])
    sum_d = np.array([(s[0] - s[1]).sum() for s in seqs])
    lpd = mean_i - mean_t
    rho2 = np.exp(np.clip(d, -20, 20)) ** 2
    m = np.log(0.5 * pt + 0.5 * pi)
    js = 0.5 * (np.exp(tok_t - m) - (tok_t - m) - 1) + 0.5 * (np.exp(tok_i - m) - (tok_i - m) - 1)
    geo = np.exp(sum_d / np.array([len(s[0]) for s in seqs]))
    n_s = np.array([len(s[0]) for s in seqs], float)
    with np.errstate(over="ignore"):
        trl = np.exp(sum_d)
    trl = np.where(trl > th.seq_mis, 0.0, trl)  # TRL's clip_max under sequence_mask is the spec's seq_mis

    def slime(per_seq: np.ndarray, per_token: np.ndarray | None = None) -> tuple[float, float]:
        """(default: mean of sequence means, per-token: mean over tokens of the expanded values)."""
        tokw = per_token.mean() if per_token is not None else (per_seq * n_s).sum() / n_s.sum()
        return per_seq.mean(), tokw

    slime_rows = {
        "training_log_ppl": slime(-mean_t),
        "training_ppl": slime(np.exp(-mean_t)),
        "rollout_log_ppl": slime(-mean_i),
        "rollout_ppl": slime(np.exp(-mean_i)),
        "kl": slime(np.array([(s[1] - s[0]).mean() for s in seqs]), -d),
        "k3_kl": slime(np.array([(np.exp(s[0] - s[1]) - (s[0] - s[1]) - 1).mean() for s in seqs]), k3),
        "log_ppl_diff": slime(lpd),
        "log_ppl_abs_diff": slime(np.abs(lpd)),
        "ppl_ratio": slime(np.exp(lpd)),
        "chi2_token": slime(np.array([(np.exp(np.clip(s[0] - s[1], -20, 20)) ** 2).mean() - 1 for s in seqs])),
        "chi2_seq": slime(np.exp(2 * np.clip(sum_d, -20, 20)) - 1),
    }
    slime_out = {}
    for name, (default, per_token) in slime_rows.items():
        slime_out[f"mis_{name}"] = default
        slime_out[f"mis_{name}[per-token]"] = per_token
    slime_out["train_rollout_logprob_abs_diff"] = np.mean([np.abs(s[0] - s[1]).mean() for s in seqs])
    slime_out["train_rollout_logprob_abs_diff[per-token]"] = np.abs(d).mean()
    rc = np.exp(np.clip(d, -20, 20))
    return {
        "verl": {
            "rollout_corr/k3_kl": k3.mean(),
            "rollout_corr/kl": (tok_i - tok_t).mean(),
            "rollout_corr/training_ppl": np.exp(-mean_t).mean(),
            "rollout_corr/rollout_ppl": np.exp(-mean_i).mean(),
            "rollout_corr/log_ppl_diff": lpd.mean(),
            "rollout_corr/log_ppl_abs_diff": np.abs(lpd).mean(),
            "rollout_corr/log_ppl_diff_max": lpd.max(),
            "rollout_corr/log_ppl_diff_min": lpd.min(),
            "rollout_corr/training_log_ppl": (-mean_t).mean(),
            "rollout_corr/rollout_log_ppl": (-mean_i).mean(),
            "rollout_corr/ppl_ratio": np.exp(lpd).mean(),
            "rollout_corr/chi2_token": rho2.mean() - 1,
            "rollout_corr/chi2_seq": (np.exp(2 * np.clip(sum_d, -20, 20))).mean() - 1,
            "training/rollout_probs_diff_mean": np.abs(pt - pi).mean(),
            "training/rollout_probs_diff_max": np.abs(pt - pi).max(),
            "training/rollout_probs_diff_std": np.abs(pt - pi).std(ddof=1),
        },
        "nemo-rl": {
            "token_mult_prob_error": np.exp(np.abs(d)).mean(),
            # calculate_kl(logprobs=gen, reference=prev): logr = prev - gen = d
            "gen_kl_error": (np.exp(d) - 1 - d).mean(),
            "gen_kl_error[k1]": (-d).mean(),
            "gen_kl_error[k2]": (d**2 / 2).mean(),
            # calculate_kl(logprobs=prev, reference=gen): logr = gen - prev = -d
            "policy_kl_error": (np.exp(-d) - 1 + d).mean(),
            "policy_kl_error[k1]": d.mean(),
            "policy_kl_error[k2]": (d**2 / 2).mean(),
            "js_divergence_error": js.mean(),
            "sampling_importance_ratio": np.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0).mean(),
            "is_oob_ratio[tis]": ((r > th.token_tis) | (r < 0.0)).mean(),
            "is_oob_ratio[icepop]": (~((r >= th.token_mask_low) & (r <= th.token_mask_high))).mean(),
            "is_oob_ratio[seq-mask-tis]": (~((geo >= 1 - th.geo_eps) & (geo <= 1 + th.geo_eps))).mean(),
        },
        "slime": slime_out,
        "prime-rl": {
            "mismatch_kl/all/mean": k3.mean(),
            "mismatch_kl/all/std": k3.std(ddof=1),
            "mismatch_kl/all/max": k3.max(),
            "mismatch_kl/all/min": k3.min(),
        },
        "skyrl": {
            "is_ratio_mean": rc.mean(),
            "is_ratio_max": rc.max(),
            "is_ratio_std": rc.std(ddof=1),
            "tis_token_clip_high_ratio": (r > th.token_tis).mean(),
            "geo_sequence_mask_masked_ratio": ((geo < 1 - th.geo_eps) | (geo > 1 + th.geo_eps)).mean(),
            "geo_sequence_mask_over_high_ratio": (geo > 1 + th.geo_eps).mean(),
            "geo_sequence_mask_under_low_ratio": (geo < 1 - th.geo_eps).mean(),
            "policy/rollout_train_logprobs_abs_diff_mean": np.abs(d).mean(),
            "policy/rollout_train_logprobs_abs_diff_std": np.abs(d).std(ddof=1),
            "policy/rollout_train_logprobs_abs_diff_max": np.abs(d).max(),
            "policy/rollout_train_logprobs_abs_diff_min": np.abs(d).min(),
        },
        "openrlhf": {"vllm_kl": (tok_i - tok_t).mean()},
        "trl": {
            "sampling/sampling_logp_difference/mean": np.abs(d).mean(),
            "sampling/sampling_logp_difference/max": np.abs(d).max(),
            "sampling/importance_sampling_ratio/min": trl.min(),
            "sampling/importance_sampling_ratio/mean": trl.mean(),
            "sampling/importance_sampling_ratio/max": trl.max(),
        },
    }


@pytest.mark.parametrize(("seed", "extreme"), [(0, False), (1, False), (2, True)])
def test_every_peer_metric_is_its_frameworks_formula_in_float64(seed, extreme):
    seqs = run(seed, extreme=extreme)
    got = pm.dashboard(accumulate(seqs))
    want = expected(seqs)
    assert {fw: sorted(v) for fw, v in got.items()} == {fw: sorted(v) for fw, v in want.items()}
    for fw, metrics in want.items():
        for key, value in metrics.items():
            assert got[fw][key] == pytest.approx(float(value), rel=1e-12, abs=1e-15), (fw, key)


def test_shards_do_not_change_the_result():
    seqs = run(3)
    one, many = pm.dashboard(accumulate(seqs, 1)), pm.dashboard(accumulate(seqs, 7))
    for fw in one:
        for key in one[fw]:
            assert many[fw][key] == pytest.approx(one[fw][key], rel=1e-12, abs=1e-15), (fw, key)


def test_equal_log_probs_give_no_mismatch_under_any_name():
    li = -np.linspace(0.01, 3.0, 50)
    seqs = [(li[:20].copy(), li[:20].copy()), (li[20:].copy(), li[20:].copy())]
    got = pm.dashboard(accumulate(seqs, 1))
    assert got["slime"]["mis_k3_kl"] == 0 and got["slime"]["mis_chi2_token"] == 0 and got["slime"]["mis_ppl_ratio"] == 1
    assert got["nemo-rl"]["token_mult_prob_error"] == 1 and abs(got["nemo-rl"]["js_divergence_error"]) < 1e-16
    assert got["prime-rl"]["mismatch_kl/all/max"] == 0 and got["skyrl"]["is_ratio_mean"] == 1
    assert got["trl"]["sampling/importance_sampling_ratio/mean"] == 1 and got["openrlhf"]["vllm_kl"] == 0


def test_slimes_default_reduction_is_not_the_token_mean():
    """A long sequence that barely moves and a short one that moves a lot: slime's default mean of
    sequence means weighs the short one as much as the long one; the probe's k3_kl (and slime's
    per-token reduction) weigh tokens."""
    long_ = (np.full(99, -0.5), np.full(99, -0.5))
    short = (np.array([-0.1]), np.array([-0.6]))  # d = 0.5
    got = pm.dashboard(accumulate([long_, short], 1))["slime"]
    k3 = math.exp(0.5) - 0.5 - 1
    assert got["mis_k3_kl"] == pytest.approx(k3 / 2, rel=1e-14)
    assert got["mis_k3_kl[per-token]"] == pytest.approx(k3 / 100, rel=1e-14)


def test_an_sd_streamed_over_shards_keeps_its_digits_when_the_mean_dwarfs_it():
    """An importance ratio ~1 with an sd of 1e-7 (an fp32 run): the sd of r, |δ|, K3 and |Δp| streamed
    over uneven shards equals numpy's two-pass sd in float64 to 1e-9; the sum of squares less n·mean²
    kept only a few digits of it."""
    rng = np.random.default_rng(7)
    seqs = []
    for i in range(50):
        li = -rng.exponential(0.8, 1 + i % 13)
        seqs.append((li + rng.normal(0, 1e-7, len(li)), li))
    stats = accumulate(seqs, shards=7)
    d = np.concatenate([s[0] - s[1] for s in seqs])
    pt, pi = np.exp(np.concatenate([s[0] for s in seqs])), np.exp(np.concatenate([s[1] for s in seqs]))
    want = {
        "is_ratio_std": np.exp(d).std(ddof=1),
        "policy/rollout_train_logprobs_abs_diff_std": np.abs(d).std(ddof=1),
        "mismatch_kl/all/std": (np.exp(d) - d - 1).std(ddof=1),
        "training/rollout_probs_diff_std": np.abs(pt - pi).std(ddof=1),
    }
    got = {k: v for fw in pm.dashboard(stats).values() for k, v in fw.items()}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_trls_sequence_mask_drops_at_its_clip_max_which_the_spec_holds_as_seq_mis():
    """TRL's default sequence_mask zeroes a sequence whose ratio exceeds clip_max (grpo_trainer.py:2614-2619);
    frameworks/trl.py reads clip_max into seq_mis there. A ratio of 2.7 lies between TH's token_tis
    (2.5) and seq_mis (3.0): kept; one of 3.3: zeroed."""
    li = np.array([-1.0, -2.0])
    seqs = [(li + np.log(2.7) / 2, li), (li + np.log(3.3) / 2, li)]
    got = pm.dashboard(accumulate(seqs, shards=1))["trl"]
    assert got["sampling/importance_sampling_ratio/max"] == pytest.approx(2.7, rel=1e-12)
    assert got["sampling/importance_sampling_ratio/min"] == 0.0
    assert got["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.35, rel=1e-12)


def test_a_run_without_tokens_has_no_values():
    got = pm.PeerAccumulator(TH).result()
    assert all(v is None for metrics in got.values() for v in metrics.values())


def test_the_registry_names_known_frameworks_once_per_key():
    from mismatch_probe.frameworks import FRAMEWORKS

    assert set(pm.frameworks()) <= set(FRAMEWORKS)
    keys = [(m.framework, m.key) for m in pm.PEER_METRICS]
    assert len(keys) == len(set(keys))
    for m in pm.PEER_METRICS:
        assert "@" in m.source and ":" in m.source.split(" ", 1)[1], m.source  # commit and file:line
        assert "." not in m.key, m.key  # a gate names it as dashboard.<framework>.<key>


def test_the_reports_dashboard_is_run_dashboard_and_the_gate_reads_it(tmp_path):
    """On the committed example: `report --framework slime` shows the table Run.dashboard("slime")
    returns, row for row, records the framework, and a gate check names a dashboard value."""
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from mismatch_probe import load_run
    from mismatch_probe.cli import app
    from mismatch_probe.numbers import fmt

    example = Path(__file__).resolve().parents[2] / "reports" / "example"
    run_dir = tmp_path / "example"
    shutil.copytree(example, run_dir)
    result = CliRunner().invoke(app, ["report", str(run_dir), "--framework", "slime"])
    assert result.exit_code == 0, result.output
    frame = load_run(run_dir).dashboard("slime")
    assert list(frame["key"]) == [m.key for m in pm.metrics_of("slime")]
    assert load_run(run_dir).record.spec.stack == {"framework": "slime"}
    md = (run_dir / "report.md").read_text()
    section = md.split("## Your dashboard: slime", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    assert [r[0].strip("| `") for r in rows] == list(frame["key"])
    assert [r[1] for r in rows] == [fmt(v) for v in frame["value"]]
    # the slime default reduction against the probe's token mean, on the same run
    k3 = frame.set_index("key").loc["mis_k3_kl[per-token]"]
    assert k3["value"] == pytest.approx(k3["probe_value"], rel=1e-12) and k3["probe"] == "k3_kl"
    gate = tmp_path / "gate.toml"
    value = frame.set_index("key").loc["mis_k3_kl", "value"]
    gate.write_text(f'[[checks]]\nmetric = "dashboard.slime.mis_k3_kl"\nop = "<="\nthreshold = {value * 1.01}\n')
    assert CliRunner().invoke(app, ["gate", str(run_dir), "--thresholds", str(gate)]).exit_code == 0
    gate.write_text(f'[[checks]]\nmetric = "dashboard.slime.mis_k3_kl"\nop = "<="\nthreshold = {value * 0.99}\n')
    assert CliRunner().invoke(app, ["gate", str(run_dir), "--thresholds", str(gate)]).exit_code == 1
    bad = CliRunner().invoke(app, ["report", str(run_dir), "--framework", "nope"])
    assert bad.exit_code == 2 and "has no dashboard" in bad.output


@pytest.mark.parametrize("framework", pm.frameworks())
def test_every_named_probe_counterpart_equals_the_dashboard_value(framework):
    """A row names a probe metric only where the two are the same number (the report prints them
    side by side as equal): on the committed example, every such pair agrees to float rounding."""
    from pathlib import Path

    from mismatch_probe import load_run

    example = Path(__file__).resolve().parents[2] / "reports" / "example"
    frame = load_run(example).dashboard(framework)
    linked = frame[frame["probe"].notna()]
    for row in linked.itertuples():
        assert row.value is not None and row.probe_value is not None, row.key
        assert row.value == pytest.approx(row.probe_value, rel=1e-9, abs=1e-15), (row.key, row.probe)


def test_a_timeline_step_carries_the_dashboard_and_its_gate_names_it():
    """steps.parquet's all row holds every framework's metric of the step, as run.json names it, equal
    to the dashboard of the same tokens; the timeline gate reads a check of that name from that column."""
    from mismatch_probe.analysis.timeline import DASHBOARD_COLUMNS, STEP_SCHEMA, StepTokens, step_rows
    from mismatch_probe.gate.timeline import step_column

    seqs = run(5)
    lengths = [len(s[0]) for s in seqs]
    tokens = StepTokens(
        sample_id=np.repeat(np.arange(len(seqs)), lengths),
        turn=np.zeros(sum(lengths), np.int16),
        position=np.concatenate([np.arange(n) for n in lengths]),
        logp_infer=np.concatenate([s[1] for s in seqs]),
        logp_train=np.concatenate([s[0] for s in seqs]),
        n_samples=len(seqs),
    )
    row = next(r for r in step_rows(7, tokens, TH, n_boot=50) if r["group"] == "all")
    want = pm.dashboard(accumulate(seqs, 1))
    assert set(DASHBOARD_COLUMNS) <= set(STEP_SCHEMA.names)
    for fw, metrics in want.items():
        for key, value in metrics.items():
            column = f"dashboard.{fw}.{key}"
            assert row[column] == pytest.approx(value, rel=1e-12, abs=1e-15), column
            assert step_column(column) == ("all", column)
