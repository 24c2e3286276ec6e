"""The drift test (analysis/drift.py): its false-alarm rate and detection, measured over many simulated
runs (each step's K3 and its interval computed from simulated sequences, as the sweep computes them),
and small examples checked by hand."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import numpy as np
import pytest

from mismatch_probe.analysis import drift
from mismatch_probe.analysis.drift import (
    DriftResult,
    change_location,
    cusum,
    detect_drift,
    drift_threshold,
    fit_baseline,
)
from mismatch_probe.analysis.intervals import _replicates, bootstrap_intervals

N_SEQUENCES, N_BOOT, LEVEL = 64, 200, 0.95
Z95 = 1.959963984540054  # the normal quantile of a 95% interval


def simulate_runs(
    n_runs: int,
    n_steps: int = 200,
    *,
    seed: int,
    shift=None,
    tau: float = 0.15,
    sequence_sd: float = 1.0,
    token_shape: float = 0.1,
    base: float = 1e-3,
    chunk: int = 50,
    with_columns: bool = False,
):
    """K3 of each step of ``n_runs`` simulated RL runs, with each step's 95% sequence-bootstrap interval.

    A step scores 64 sequences of 20-4096 tokens (log-normal lengths around 400). Its true K3 level
    moves from step to step by ``tau`` in log (the policy changes) times ``shift(steps)`` (the injected
    drift, a factor). Sequences differ in their own mismatch (a log-normal factor of sd ``sequence_sd``)
    and a sequence's ``k3_sum`` sums per-token K3 values that are gamma with shape ``token_shape`` (a
    few tokens carry most of it, as with real K3). The interval is what ``bootstrap_intervals(columns,
    ["k3_kl"], n_boot=200, seed=0)`` gives each step: the same replicate counts for every step, one
    matrix product for all steps (:func:`test_the_vectorized_bootstrap_is_bootstrap_intervals` checks
    it). Returns steps, value, low, high ([runs, steps] arrays) and, with ``with_columns``, the
    per-sequence ``k3_sum`` and ``n_tokens`` ([runs, steps, sequences])."""
    steps = np.arange(n_steps)
    factor = np.ones(n_steps) if shift is None else np.asarray(shift(steps), np.float64)
    counts = np.concatenate(list(_replicates(N_SEQUENCES, N_BOOT, 0, None))).T  # bootstrap_intervals' draws
    tail = (1 - LEVEL) / 2
    # np.quantile(..., method="nearest") as bootstrap_intervals takes it: these order statistics
    ranks = np.quantile(np.arange(N_BOOT), [tail, 1 - tail], method="nearest").astype(int)
    parts: list[tuple[np.ndarray, ...]] = []
    for start in range(0, n_runs, chunk):
        rng = np.random.default_rng([seed, start])
        size = min(chunk, n_runs - start)
        level = np.log(base) + tau * rng.standard_normal((size, n_steps)) + np.log(factor)
        n_tokens = np.clip(np.exp(rng.normal(np.log(400), 0.8, (size, n_steps, N_SEQUENCES))), 20, 4096).round()
        rate = np.exp(level[..., None] + sequence_sd * rng.standard_normal(n_tokens.shape) - sequence_sd**2 / 2)
        k3_sum = rng.gamma(token_shape * n_tokens, rate / token_shape)
        value = k3_sum.sum(-1) / n_tokens.sum(-1)
        flat = (size * n_steps, N_SEQUENCES)  # one matrix product for every step of the chunk
        replicates = (k3_sum.reshape(flat) @ counts) / (n_tokens.reshape(flat) @ counts)
        low, high = np.partition(replicates, ranks, axis=-1)[:, ranks].T.reshape(2, size, n_steps)
        parts.append((value, low, high, k3_sum, n_tokens) if with_columns else (value, low, high))
    return (steps, *(np.concatenate(p) for p in zip(*parts, strict=True)))


def run_all(steps, value, low, high, **kw) -> list[DriftResult]:
    return [detect_drift(steps, value[i], low[i], high[i], metric="k3_kl", **kw) for i in range(len(value))]


def simulate_token_steps(n_steps: int, *, seed: int, n_sequences: int = 64, k3_factor=None, tau: float = 0.15):
    """The model tokens of each step of one simulated RL run, as ``StepTokens`` (what the timeline reads
    from a dump), for the run-level false-alarm rate over *every* drift metric (each step then goes
    through the real ``step_rows``, and the run through ``drift_tests``).

    A step samples ``n_sequences`` sequences of 20-2048 tokens (log-normal around 300). The engine's
    log-probs are mostly confident (70% of tokens within ~0.02 of 0) with a long tail; the trainer's
    differ by a heavy-tailed amount (Student t, 3 dof: a few tokens carry most of the mismatch) scaled
    per sequence (log-normal, sd 0.5) and per step (log-normal, sd ``tau``: the policy moves), clipped
    at 0. ``k3_factor(step)`` multiplies the step's mismatch scale by its square root (K3 grows with
    the square of small log-prob differences, so a factor 2 doubles K3)."""
    from mismatch_probe.analysis.timeline import StepTokens

    rng = np.random.default_rng(seed)
    for step in range(n_steps):
        factor = 1.0 if k3_factor is None else float(k3_factor(step))
        scale = 0.03 * math.exp(tau * rng.standard_normal()) * math.sqrt(factor)
        n_tokens = np.clip(np.exp(rng.normal(math.log(300), 0.8, n_sequences)), 20, 2048).astype(np.int64)
        total = int(n_tokens.sum())
        sample_id = np.repeat(np.arange(n_sequences), n_tokens)
        position = np.arange(total) - np.repeat(np.cumsum(n_tokens) - n_tokens, n_tokens)
        confident = rng.random(total) < 0.7
        logp_infer = np.where(confident, -rng.exponential(0.02, total), -rng.exponential(1.5, total))
        per_sequence = np.exp(0.5 * rng.standard_normal(n_sequences))[sample_id]
        logp_train = np.minimum(logp_infer + scale * per_sequence * rng.standard_t(3, total), 0.0)
        yield StepTokens(
            sample_id=sample_id,
            turn=np.zeros(total, np.int16),
            position=position,
            logp_infer=logp_infer,
            logp_train=logp_train,
            n_samples=n_sequences,
        )


def token_level_run(n_steps: int, *, seed: int, baseline_steps: int = 20, alpha: float = 0.05, k3_factor=None):
    """One simulated run through the timeline's own code: ``step_rows`` per step, ``drift_tests`` over
    them. Returns the drift results by metric."""
    from mismatch_probe.analysis.timeline import rows_table, step_rows
    from mismatch_probe.timeline.runner import drift_tests

    rows = [
        row
        for step, tokens in enumerate(simulate_token_steps(n_steps, seed=seed, k3_factor=k3_factor))
        for row in step_rows(step, tokens, n_boot=200)
    ]
    return drift_tests(rows_table(rows), baseline_steps=baseline_steps, alpha=alpha)


def test_metric_alpha_splits_the_run_rate_over_the_metrics():
    assert drift.metric_alpha(0.05, 8) == pytest.approx(0.00625)
    assert drift.metric_alpha(0.05, 1) == 0.05
    for bad in ((0.05, 0), (0.0, 3), (0.6, 3)):
        with pytest.raises(ValueError):
            drift.metric_alpha(*bad)


def test_a_timeline_tests_each_metric_at_its_share_of_the_run_rate():
    """drift_tests splits alpha over the metrics the run has (a dense run has no routing metric), and the
    run's threshold is the one of that share."""
    from mismatch_probe.analysis.timeline import DRIFT_METRICS

    results = token_level_run(30, seed=3)
    tested = [m for m in DRIFT_METRICS if m != "routing_flip_share"]
    assert sorted(results) == sorted(tested)
    for metric, result in results.items():
        assert result["alpha"] == pytest.approx(0.05 / len(tested)), metric
        assert result["threshold"] == pytest.approx(drift_threshold(20, 10, alpha=0.05 / len(tested)))


def test_stationary_token_level_runs_alarm_on_no_metric():
    """Runs with no drift through the timeline's own step rows: no metric alarms on any of 12 seeded runs
    (benchmarks/bench_drift.py measures the rate over hundreds: under 5% per run)."""
    alarms = {s: [m for m, r in token_level_run(40, seed=100 + s).items() if r["detected"]] for s in range(12)}
    assert not any(alarms.values()), alarms


def test_a_2x_k3_rise_on_token_level_runs_alarms_on_k3():
    """The same runs with K3 doubled from step 25 on: K3's test alarms on every one, after the rise."""
    for s in range(4):
        result = token_level_run(45, seed=200 + s, k3_factor=lambda step: 2.0 if step >= 25 else 1.0)["k3_kl"]
        assert result["detected"] and result["alarm_step"] >= 25, (s, result)


def test_the_power_of_a_shift_by_hand():
    """shift_power is the share of simulated clipped CUSUMs past h within the steps: a shift far above
    the threshold's reach is always caught, none is caught when h is out of reach, and it grows with
    the shift."""
    assert drift.shift_power(3.0, 5.0, steps=20) == 1.0
    assert drift.shift_power(0.0, 1e6, steps=20) == 0.0
    # 20 steps of at most Z_CLIP - k = 2.25 each cannot pass 46
    assert drift.shift_power(10.0, 46.0, steps=20) == 0.0
    powers = [drift.shift_power(s, 10.0, steps=20) for s in (0.5, 1.0, 1.5, 2.0)]
    assert powers == sorted(powers) and powers[0] < 0.5 < powers[-1]
    assert drift.shift_power(1.0, 10.0) == drift.shift_power(1.0, 10.0)  # seeded


def test_the_power_a_result_states_is_its_own_noise_and_threshold():
    steps, value, low, high = simulate_runs(1, 60, seed=9)
    r = detect_drift(steps, value[0], low[0], high[0], alpha=0.01)
    assert r.step_sd is not None and r.power is not None
    assert r.power == drift.shift_power(math.log(2.0) / r.step_sd, r.threshold)
    assert detect_drift(steps, value[0], scale="linear").power is None


def test_the_vectorized_bootstrap_is_bootstrap_intervals():
    _, value, low, high, k3_sum, n_tokens = simulate_runs(2, 6, seed=5, with_columns=True)
    for run, step in [(0, 0), (0, 5), (1, 3)]:
        columns = {"n_tokens": n_tokens[run, step], "k3_sum": k3_sum[run, step]}
        interval = bootstrap_intervals(columns, ["k3_kl"], n_boot=N_BOOT, level=LEVEL, seed=0)["k3_kl"]
        assert interval.estimate == pytest.approx(value[run, step], rel=1e-12)
        assert interval.low == pytest.approx(low[run, step], rel=1e-12)
        assert interval.high == pytest.approx(high[run, step], rel=1e-12)


# ------------------------------------------------------------------------------------- calibration


def test_stationary_runs_false_alarm_at_most_alpha():
    """600 runs of 200 steps with no drift (20-step baseline, 180 monitored): alarms in at most 5%.
    (benchmarks/bench_drift.py measures ~3% over thousands of such runs; 600 keep this one's sampling
    error, ~0.7%, well inside the margin.)"""
    steps, value, low, high = simulate_runs(600, seed=1)
    results = run_all(steps, value, low, high)
    rate = np.mean([r.detected for r in results])
    assert rate <= 0.05, f"false-alarm rate {rate:.3f} over {len(results)} stationary runs, alpha 0.05"
    assert all(r.reason is None and r.horizon == 180 for r in results)
    # the fitted between-step variation is the simulated one plus what the bootstrap misses of the
    # sampling noise (a percentile bootstrap of 64 heavy-tailed sequences runs a little narrow)
    assert 0.12 < np.median([r.tau for r in results]) < 0.25


@pytest.mark.parametrize("direction", ["up", "both"])
def test_under_its_own_model_the_rate_is_alpha_give_or_take_the_simulation(direction):
    """Normal steps, no intervals: exactly the model the threshold simulates, through detect_drift's
    own code. The rate is at most alpha and not far below it (the threshold is not needlessly high)."""
    rng = np.random.default_rng(2)
    values = 3.0 + 0.2 * rng.standard_normal((1500, 120))
    steps = np.arange(120)
    rate = np.mean([detect_drift(steps, v, scale="linear", direction=direction).detected for v in values])
    assert 0.025 <= rate <= 0.05, f"{direction}: false-alarm rate {rate:.4f} over 1500 runs, alpha 0.05"


CHANGE = 120


@pytest.mark.parametrize(
    ("factor", "min_detected", "max_p90_delay"),
    [(3.0, 0.95, 4), (2.0, 0.9, 7)],
)
def test_a_step_change_is_found_within_a_few_steps(factor, min_detected, max_p90_delay):
    """K3 x2 or x3 from step 120 on (the per-step noise is ~0.25 in log, so x2 is ~2.8 sd)."""
    steps, value, low, high = simulate_runs(
        250, seed=int(10 * factor), shift=lambda s: np.where(s >= CHANGE, factor, 1)
    )
    results = run_all(steps, value, low, high)
    found = [r for r in results if r.detected and r.alarm_step >= CHANGE]
    rate = len(found) / len(results)
    assert rate >= min_detected, f"x{factor}: detected in {rate:.3f} of {len(results)} runs"
    delay = np.array([r.alarm_step - CHANGE for r in found])
    error = np.array([r.change_step - CHANGE for r in found])
    covered = np.mean([r.interval[0] <= CHANGE <= r.interval[1] for r in found])
    assert np.percentile(delay, 90) <= max_p90_delay, f"x{factor}: alarm delays p90 {np.percentile(delay, 90)}"
    assert np.median(np.abs(error)) <= 1, f"x{factor}: median |change step error| {np.median(np.abs(error))}"
    assert covered >= 0.85, f"x{factor}: the change interval covers step {CHANGE} in {covered:.2f} of the runs"
    ratio = np.median([r.ratio for r in found])
    assert factor / 1.5 < ratio < factor * 1.5, f"x{factor}: median after/baseline {ratio:.2f}"


def test_a_gradual_climb_is_found_and_dated_near_its_start():
    """K3 climbs linearly in log from step 120 to x3 at step 160: found in nearly every run; the
    change is dated where the climb became clear, some steps after its first step."""
    ramp = lambda s: np.exp(np.log(3) * np.clip((s - CHANGE + 1) / 40, 0, 1))
    steps, value, low, high = simulate_runs(250, seed=7, shift=ramp)
    results = run_all(steps, value, low, high)
    found = [r for r in results if r.detected and r.alarm_step >= CHANGE]
    rate = len(found) / len(results)
    assert rate >= 0.9, f"ramp: detected in {rate:.3f} of {len(results)} runs"
    delay = np.median([r.alarm_step - CHANGE for r in found])
    error = np.median([r.change_step - CHANGE for r in found])
    assert delay <= 25, f"ramp: median alarm delay {delay}"
    assert 0 <= error <= 10, f"ramp: median change step error {error}"


# ------------------------------------------------------------------------------------ by hand


def test_cusum_by_hand():
    # S = max(0, S + z - 0.5): 0.5, 2.0, max(0, 2 - 3.5) = 0, max(0, 0 + 0) = 0, 1.5
    assert cusum(np.array([1.0, 2.0, -3.0, 0.5, 2.0]), 0.5) == pytest.approx([0.5, 2.0, 0.0, 0.0, 1.5])
    assert cusum(np.array([-1.0, -1.0]), 0.5).tolist() == [0.0, 0.0]


def test_change_location_by_hand():
    # z = 0, 0, 2, 2, 2: a change at index 2 gains (2+2+2)^2/3 = 12; at 1, 6^2/4 = 9; at 3, 4^2/2 = 8;
    # at 0, 36/5 = 7.2; at 4, 4. Within 3.84 of 12: indices 1 and 2
    assert change_location(np.array([0.0, 0.0, 2.0, 2.0, 2.0])) == (2, 1, 2)
    assert change_location(np.array([0.0, 0.0, 3.0, 3.0, 3.0])) == (2, 2, 2)  # 27 against 20.25 at 1
    # z = 0, 1, 1: at 1, 4/2 = 2; at 0, 4/3; at 2, 1; all within 3.84
    assert change_location(np.array([0.0, 1.0, 1.0])) == (1, 0, 2)
    # a fall is no evidence of a rise, unless unsigned
    assert change_location(np.array([0.0, -2.0, -2.0]), signed=True)[0] == 0  # every gain is 0
    assert change_location(np.array([0.0, -2.0, -2.0]), signed=False)[0] == 1


def test_fit_baseline_by_hand():
    y = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    mu, tau2, var_mu = fit_baseline(y)  # no sampling noise: the mean and the sample variance
    assert (float(mu), float(tau2), float(var_mu)) == pytest.approx((3.0, 2.5, 0.5))
    # sampling variance 1 each: the moment equation says 2.5 - 1 = 1.5 of it is between-step
    mu, tau2, var_mu = fit_baseline(y, np.ones(5))
    assert (float(mu), float(tau2), float(var_mu)) == pytest.approx((3.0, 1.5, 2.5 / 5))
    # sampling noise larger than the spread: tau2 floored at 0, the mean weighted by 1 / v
    mu, tau2, _ = fit_baseline(np.array([1.0, 3.0, 1.0, 3.0]), np.array([4.0, 4.0, 1.0, 1.0]))
    assert (float(mu), float(tau2)) == pytest.approx((2.0, 0.0))
    mu, tau2, _ = fit_baseline(np.array([1.0, 3.0, 3.0, 3.0]), np.array([1.0, 4.0, 4.0, 4.0]))
    assert float(mu) == pytest.approx((1 / 1 + 9 / 4) / (1 + 3 / 4)) and float(tau2) == 0.0
    # a spike 5 robust sd out is left out of the fit: the other 19 set the baseline
    spiked = np.append(np.tile([0.9, 1.1], 9) + [0.0] * 18, [1.0, 50.0])
    mu, tau2, _ = fit_baseline(spiked)
    assert float(mu) == pytest.approx(np.mean(spiked[:-1])) and float(tau2) == pytest.approx(
        np.var(spiked[:-1], ddof=1)
    )
    # rows are runs
    mus, _, _ = fit_baseline(np.stack([y, y + 10]))
    assert mus.tolist() == pytest.approx([3.0, 13.0])


def test_a_jump_by_hand():
    """Baseline 0.9, 1.1, ... (20 steps, each +-0.2 sampling sd, so tau = 0 and mu = 1, Var(mu) =
    0.04 / 20), 10 steps at 1.0 (z = 0), then 6 at 1.5: z = 0.5 / sqrt(0.04 + 0.002) = 2.4398, and the
    CUSUM climbs 2.4398 - 0.75 = 1.6898 a step. Steps are numbered 100, 102, ... (gaps)."""
    values = np.array([0.9, 1.1] * 10 + [1.0] * 10 + [1.5] * 6)
    steps = 100 + 2 * np.arange(len(values))
    result = detect_drift(steps, values, values - Z95 * 0.2, values + Z95 * 0.2, metric="x", scale="linear")
    z = 0.5 / math.sqrt(0.042)
    climb = z - drift.DEFAULT_K
    h = drift_threshold(20, 16)
    assert result.threshold == h and result.horizon == 16 and result.n_baseline == 20
    assert result.statistic == pytest.approx(6 * climb, rel=1e-9)
    assert result.tau == 0.0 and result.baseline == pytest.approx(1.0) and result.baseline_steps == (100, 138)
    assert result.detected
    first_high = 100 + 2 * 30
    assert result.change_step == first_high and result.interval == (first_high, first_high)
    assert result.alarm_step == first_high + 2 * (math.ceil(h / climb) - 1)
    assert result.after == 1.5 and result.ratio is None
    # the same, one step shorter of elevated values than the alarm needs: nothing found
    short = math.ceil(h / climb) - 1
    cut = 30 + short
    quiet = detect_drift(steps[:cut], values[:cut], values[:cut] - Z95 * 0.2, values[:cut] + Z95 * 0.2, scale="linear")
    assert quiet.statistic == pytest.approx(short * climb) and not quiet.detected


# ----------------------------------------------------------------------------------- edge cases


def test_too_few_steps_or_values():
    few = detect_drift(np.arange(20), np.ones(20), metric="k3_kl")
    assert not few.detected and "20 observed steps" in few.reason and few.change_step is None
    nan = detect_drift(np.arange(50), np.full(50, np.nan))
    assert not nan.detected and nan.reason
    infs = np.ones(40)
    infs[:17] = np.inf  # 3 finite values in the 20-step window
    result = detect_drift(np.arange(40), infs)
    assert not result.detected and "3 finite values" in result.reason
    assert any("infinite" in note for note in result.notes)
    assert "not tested" in result.summary()


def test_missing_steps_are_skipped():
    rng = np.random.default_rng(4)
    values = np.exp(rng.normal(0, 0.2, 80))
    values[60:] *= 4
    holes = values.copy()
    holes[[3, 25, 61]] = np.nan
    keep = ~np.isnan(holes)
    a = detect_drift(np.arange(80), holes)
    b = detect_drift(np.arange(80)[keep], values[keep])
    assert a == b and a.detected and a.change_step == 60 and a.n_monitored == 80 - 3 - 20


def test_constant_values_divide_by_no_zero():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = detect_drift(np.arange(60), np.full(60, 0.25), np.full(60, 0.25), np.full(60, 0.25))
        assert not flat.detected and flat.tau == 0.0 and flat.statistic == 0.0
        jump = np.full(60, 0.25)
        jump[45:] = 0.26
        found = detect_drift(np.arange(60), jump, scale="linear")
        # any change from a constant is a huge z, but each step counts at most 3 - 0.75 = 2.25: the
        # CUSUM reads 2.25, 4.5, 6.75 and the threshold for 40 monitored steps is ~4.9
        assert 4.5 < found.threshold < 6.75
        assert found.detected and found.change_step == 45 and found.alarm_step == 47
        zeros = detect_drift(np.arange(60), np.zeros(60), scale="linear")
        assert not zeros.detected


def test_an_infinite_value_after_the_window_is_an_alarm_there():
    rng = np.random.default_rng(5)
    values = np.exp(rng.normal(-7, 0.2, 60))
    values[40] = np.inf  # the trainer gave a sampled token p = 0
    result = detect_drift(np.arange(60), values, metric="k3_kl")
    assert result.detected and result.alarm_step == 40 and result.change_step == 40
    assert result.after == math.inf and result.ratio == math.inf
    record = result.to_dict()
    assert record["after"] == "inf" and record["ratio"] == "inf" and record["interval"] == [40, 40]
    json.dumps(record, allow_nan=False)
    # -inf is an alarm for what watches falls, "down" and "both", and not for "up"
    values[40] = -np.inf
    assert not detect_drift(np.arange(60), values, scale="linear").detected
    assert detect_drift(np.arange(60), values, scale="linear", direction="down").alarm_step == 40
    assert detect_drift(np.arange(60), values, scale="linear", direction="both").alarm_step == 40


def test_infinite_values_in_the_window_are_left_out_of_its_fit():
    rng = np.random.default_rng(6)
    values = np.exp(rng.normal(-7, 0.2, 60))
    clean = detect_drift(np.arange(60), values)
    values[[2, 9]] = np.inf
    result = detect_drift(np.arange(60), values)
    assert result.n_baseline == 18 and not result.detected and any("2 infinite" in n for n in result.notes)
    assert result.baseline_steps == clean.baseline_steps == (0, 19)


def test_zeros_on_the_log_scale_are_floored():
    values = np.r_[np.zeros(25), np.full(10, 1e-4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = detect_drift(np.arange(35), values)
    assert result.detected and result.change_step == 25 and any("floored" in n for n in result.notes)
    assert result.baseline == 0.0 and result.ratio is None


def test_directions():
    rng = np.random.default_rng(7)
    values = 0.5 + 0.01 * rng.standard_normal(100)
    values[70:] -= 0.05
    assert not detect_drift(np.arange(100), values, scale="linear").detected
    down = detect_drift(np.arange(100), values, scale="linear", direction="down")
    both = detect_drift(np.arange(100), values, scale="linear", direction="both")
    assert down.detected and down.change_step == 70 and both.detected and both.change_step == 70
    assert both.threshold > down.threshold  # two chances to alarm: a higher bar for the same alpha


def test_steps_without_intervals_get_the_typical_sampling_noise():
    rng = np.random.default_rng(8)
    values = np.exp(rng.normal(-7, 0.3, 60))
    low, high = values * 0.7, values / 0.7
    low[[5, 30]] = high[[5, 30]] = np.nan
    result = detect_drift(np.arange(60), values, low, high)
    assert any("2 steps without a finite interval" in n for n in result.notes)


def test_bad_arguments():
    steps, values = np.arange(30), np.ones(30)
    for kw in ({"scale": "sqrt"}, {"direction": "sideways"}, {"baseline_steps": 3}, {"alpha": 0.0}, {"level": 1.0}):
        with pytest.raises(ValueError):
            detect_drift(steps, values, **kw)
    with pytest.raises(ValueError, match="increasing"):
        detect_drift(steps[::-1], values)
    with pytest.raises(ValueError, match="both low and high"):
        detect_drift(steps, values, low=values)
    with pytest.raises(ValueError):
        detect_drift(steps, values[:-1])


# ------------------------------------------------------------------------ threshold and live runs


def test_the_threshold_is_reproducible_and_does_not_depend_on_the_cache():
    first = [drift_threshold(12, m) for m in (1, 50, 300)]
    drift._CURVES.clear()
    assert drift_threshold(12, 300) == first[2]  # extended in one go rather than in three
    assert [drift_threshold(12, m) for m in (1, 50)] == first[:2]
    curve = [drift_threshold(12, m) for m in range(1, 301)]
    assert all(a <= b for a, b in itertools.pairwise(curve))  # a longer window, a higher bar
    assert drift_threshold(12, 100, alpha=0.01) > drift_threshold(12, 100) > drift_threshold(12, 100, alpha=0.2)
    assert drift_threshold(12, 100) > drift_threshold(40, 100)  # a longer baseline, less estimation error


def test_a_live_run_with_a_horizon_alarms_where_the_finished_run_does():
    steps, value, low, high = simulate_runs(1, 200, seed=9, shift=lambda s: np.where(s >= 150, 2.5, 1))
    v, lo, hi = value[0], low[0], high[0]
    finished = detect_drift(steps, v, lo, hi)
    assert finished.detected and finished.horizon == 180
    live = [detect_drift(steps[:n], v[:n], lo[:n], hi[:n], horizon=180) for n in range(21, 201)]
    assert {r.threshold for r in live} == {finished.threshold}
    first = next(r for r in live if r.detected)
    assert (first.alarm_step, first.change_step, first.interval) == (
        finished.alarm_step,
        finished.change_step,
        finished.interval,
    )
    assert first.alarm_step == steps[21 + live.index(first) - 1]  # it fires on the step it was handed


def test_result_record_and_summary():
    rng = np.random.default_rng(10)
    values = np.exp(rng.normal(-7, 0.2, 100))
    values[60:] *= 3
    result = detect_drift(np.arange(100), values, metric="k3_kl")
    record = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert record["metric"] == "k3_kl" and record["detected"] and record["change_step"] == 60
    assert record["baseline_steps"] == [0, 19] and record["alpha"] == 0.05 and record["notes"] == []
    assert result.summary().startswith("k3_kl departs from its baseline at step 60")
    quiet = detect_drift(np.arange(100), np.exp(rng.normal(-7, 0.2, 100)), metric="k3_kl")
    assert "no drift" in quiet.summary()
