"""What to do next after one run: the report's "What to do next" section, decided from the run's own
numbers, each step citing the number that triggered it and the bound it was read against.

The findings, in the order a reader should act on them:

* **K3 against the published range** for the rollout's precision (``metric_docs.k3_context``'s
  ranges): above the top of the healthiest published range, the next step is the sweep
  (:func:`sweep_axes`) over the settings most likely to cause it on this stack, which the report
  writes as ``next-sweep.toml`` beside the run; inside or below it, the same sweep is offered as the
  attribution of what remains.
* **Sample size**: K3's interval against ±10% (:data:`SAMPLE_SIZE_TARGET`): a looser interval asks
  for a run with ``--precision``, with the samples it is expected to take; a run with ``--precision``
  that stopped short of its target asks for the samples it was estimated to need.
* **Decode against the engine's own prefill** (``decode_vs_prefill``): an engine whose sampled
  log-probs disagree with its own full-sequence prefill by a sizable share of the run's K3 is
  inconsistent with itself, a problem no trainer setting fixes.
* **Later turns against the first**: a later-turn K3 well above the first turn's points at the
  re-tokenization of earlier turns (what the multi-turn rollout sent against what it sampled).
* **Corrections**: of the correction what-ifs, the one that keeps the most data among those whose
  kept K3 is within this run's own noise (K3's bootstrap half-width) of the lowest kept K3.
* **A gate** from this run's intervals (:func:`suggested_checks`), written as ``suggested-gate.toml``.

Pure: a record and the rollout's precision in, steps out; the report layer writes the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mismatch_probe.analysis.intervals import Interval
from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, K3_BY_GPU, PUBLISHED_K3, fmt_range
from mismatch_probe.analysis.metrics import CORRECTION_KEYS, KEPT_K3
from mismatch_probe.analysis.precision import percent, relative_half_width, samples_needed
from mismatch_probe.config.spec import COMMON_ENGINE_SETTINGS, engine_settings
from mismatch_probe.numbers import fmt, pct
from mismatch_probe.record import RunRecord

NEXT_SWEEP = "next-sweep.toml"
SUGGESTED_GATE = "suggested-gate.toml"
# the relative half-width of K3's 95% interval the sample-size step asks for (--precision): within it, a
# re-run's K3 lands within about ±14% (sqrt(2) x 10%) of this one's, tight enough to tell a 1.5x change
SAMPLE_SIZE_TARGET = 0.1
# decode vs prefill: the engine disagreeing with itself by this share of the run's K3 or more is an
# engine problem worth its own reproduction (below it, the kernels' usual decode/prefill rounding)
PREFILL_SHARE = 0.25
# later turns: a later-turn K3 this many times the first turn's points at the re-tokenization
LATER_FACTOR = 1.5
# vLLM removed cascade attention in 0.32 (engines/api_uses.py): before it, the setting exists
CASCADE_REMOVED = (0, 32)
# a re-run's value lies below estimate + sqrt(2) x (the upper half-width) with ~97.5% probability:
# the difference of two independent estimates of one noise has sqrt(2) times its sd
RERUN_FACTOR = math.sqrt(2.0)
# the metrics a suggested gate bounds (those with a sequence-bootstrap interval), and each check's severity
GATE_METRICS = {
    "k3_kl": "fail",
    "mult_prob_error": "fail",
    "prob_diff_mean": "warn",
    "prob_diff_max": "warn",
    "seq_max_mismatch_mean": "warn",
}


@dataclass(frozen=True)
class NextStep:
    """One line of "What to do next": what the run shows (with its number), what to do about it."""

    topic: str  # a short name: "K3", "decode vs prefill", "later turns", "corrections", "gate"
    finding: str  # the number that triggered it, and what it was read against
    action: str  # what to do
    command: str | None = None  # the command that does it, when there is one
    writes: str | None = None  # the file the report writes for it, beside the run
    urgent: bool = False  # whether the finding is a problem (False: the run is fine on this count)


@dataclass(frozen=True)
class Axis:
    """An axis of ``next-sweep.toml``: a setting, the values swept (the run's first), and why."""

    key: str
    values: list[Any]
    why: str


def k3_interval(record: RunRecord) -> tuple[float, float, float] | None:
    """K3's estimate and 95% sequence-bootstrap interval, from run.json's ``intervals``."""
    found = ((record.intervals or {}).get("metrics") or {}).get("k3_kl")
    return tuple(float(x) for x in found) if found else None  # type: ignore[return-value]


def published_k3_range(precision: str | None) -> tuple[float, float, str]:
    """The healthiest published K3 range for the rollout's precision, as (low, high, where): the bf16
    H20 range (the lowest per-GPU range), or the highest figure published for the precision."""
    published = [f for f in PUBLISHED_K3 if f.precision == precision]
    if precision not in (None, "bf16") and published:
        top = max(published, key=lambda f: f.high)
        return top.low, top.high, f"{precision} rollouts, {top.where}: {fmt_range(top.low, top.high)}"
    where, low, high = K3_BY_GPU[0]
    return low, high, f"bf16 rollouts on {where}: {fmt_range(low, high)}"


def _interval_text(interval: tuple[float, float, float] | None) -> str:
    return f" (95% interval {fmt(interval[1])}–{fmt(interval[2])})" if interval else ""


def k3_step(record: RunRecord, precision: str | None, axes: list[Axis], sweep_command: str) -> NextStep:
    k3 = record.metric("k3_kl")
    bottom, top, where = published_k3_range(precision)
    interval = k3_interval(record)
    named = ", ".join(a.key for a in axes) or "no axis"
    if k3 is None:
        return NextStep("K3", "no K3: the run has no model token", "check the prompts and max_tokens")
    if isinstance(k3, str) or math.isinf(k3):
        return NextStep(
            "K3",
            "K3 is infinite: the reference gives a sampled token probability 0 "
            f"({fmt(record.metric('n_zero_prob_train'))} tokens)",
            "make the two sides score the same distribution (temperature, top-p/top-k, engine.logprobs_mode, "
            f"reference.logprobs) before anything else; {NEXT_SWEEP} sweeps {named}",
            sweep_command,
            NEXT_SWEEP,
            urgent=True,
        )
    if k3 > top:
        return NextStep(
            "K3",
            f"K3 {fmt(k3)}{_interval_text(interval)} is {k3 / top:.2f}x the top of the published range for {where}",
            f"find the setting that causes it: {NEXT_SWEEP} sweeps {named}, each changed alone from this run",
            sweep_command,
            NEXT_SWEEP,
            urgent=True,
        )
    place = "below" if k3 < bottom else "inside"
    return NextStep(
        "K3",
        f"K3 {fmt(k3)}{_interval_text(interval)} is {place} the published range for {where}",
        f"nothing to fix on this count; {NEXT_SWEEP} sweeps {named} to show which of them moves it on this stack",
        sweep_command,
        NEXT_SWEEP,
    )


def sample_size_step(record: RunRecord, precision_command: str) -> NextStep | None:
    """K3's interval against the target: a run with ``--precision`` by its own outcome (run.json's
    ``precision``), any other against :data:`SAMPLE_SIZE_TARGET`."""
    # a run that re-scores another's rollouts has that run's rounds, decided on that run's K3: its own
    # interval is read against the target as any other run's
    state = record.precision if record.precision and not record.rollouts_from else {}
    if state.get("rounds") and state.get("met") is not None:
        last, target = state["rounds"][-1], float(state["target"])
        where = f"K3 ±{percent(last['relative_half_width'])} on {last['samples_total']} samples"
        if state["met"]:
            return NextStep(
                "sample size",
                f"{where}, within the target ±{percent(target)}",
                "nothing to do: K3 is as tight as asked",
            )
        more = state.get("more_samples_needed")
        if more is None:  # K3 is infinite: the K3 step says what to do
            return None
        total = int(last["samples_total"]) + int(more)
        return NextStep(
            "sample size",
            f"{where}, short of the target ±{percent(target)}: {state.get('stop')}",
            f"sample about {more} more: run again with a budget of {total} samples",
            f"{precision_command} --precision {target:g} --max-samples {total}",
            urgent=True,
        )
    interval = k3_interval(record)
    n = (record.intervals or {}).get("n_sequences")
    if interval is None or not n or not all(math.isfinite(x) for x in interval):
        return None
    relative = relative_half_width(Interval(*interval))
    where = f"K3's 95% interval is ±{percent(relative)} of K3 on {n} samples"
    if relative <= SAMPLE_SIZE_TARGET:
        return NextStep(
            "sample size", f"{where} (within ±{percent(SAMPLE_SIZE_TARGET)})", "nothing to do: enough samples"
        )
    needed = samples_needed(n, relative, SAMPLE_SIZE_TARGET)
    return NextStep(
        "sample size",
        f"{where}: a re-run of this configuration can land anywhere in it (above ±{percent(SAMPLE_SIZE_TARGET)})",
        f"sample in rounds until it is within ±{percent(SAMPLE_SIZE_TARGET)}: about {needed} samples "
        f"({needed / n:.1f}x this run)",
        f"{precision_command} --precision {SAMPLE_SIZE_TARGET:g}",
        urgent=True,
    )


def prefill_step(record: RunRecord, spec_command: str) -> NextStep | None:
    prefill = record.decode_vs_prefill or {}
    k3, own = record.metric("k3_kl"), prefill.get("k3_kl")
    if not prefill.get("n_model_tokens") or own is None or k3 is None or isinstance(k3, str):
        return None
    share = math.inf if not k3 else float(own) / float(k3)
    if own > 0 and share >= PREFILL_SHARE:
        return NextStep(
            "decode vs prefill",
            f"the engine's decode disagrees with its own prefill: K3 {fmt(own)}, {pct(share)} of the run's "
            f"K3 {fmt(k3)} (at or above {pct(PREFILL_SHARE)})",
            "an engine problem no trainer setting fixes: reproduce it on the engine alone and report it with "
            "the run's engine.log (docs/engine-findings/ shows how earlier ones were reduced)",
            spec_command,
            urgent=True,
        )
    return NextStep(
        "decode vs prefill",
        f"the engine agrees with its own prefill: K3 {fmt(own)}, {pct(share) if math.isfinite(share) else '-'} "
        f"of the run's K3 (below {pct(PREFILL_SHARE)})",
        "nothing to do: the mismatch is between the engine and the trainer, not inside the engine",
    )


def later_turns_step(record: RunRecord) -> NextStep | None:
    first, later = record.metric("k3_kl", "first"), record.metric("k3_kl", "later")
    if not record.metric("n_model_tokens", "later") or first is None or later is None:
        return None
    if isinstance(first, str) or isinstance(later, str) or not (math.isfinite(first) and math.isfinite(later)):
        return None  # an infinite K3 is the K3 line's finding, not a comparison of turns
    check = ", ".join(f"{k} {v}" for k, v in (record.tokenization_check or {}).items()) or "not recorded"
    if first > 0 and later / first >= LATER_FACTOR:
        return NextStep(
            "later turns",
            f"later turns' K3 {fmt(later)} is {later / first:.2f}x the first turn's {fmt(first)} "
            f"(at or above {LATER_FACTOR:g}x)",
            "check the re-tokenization of earlier turns: the tokens the trainer scores must be the tokens the "
            f"engine sampled (this run's re-tokenization check: {check}; docs/how-to/probe.md, re-tokenization check)",
            urgent=True,
        )
    return NextStep(
        "later turns",
        f"later turns' K3 {fmt(later)} is {f'{later / first:.2f}' if first else '-'}x the first turn's {fmt(first)} "
        f"(below {LATER_FACTOR:g}x)",
        "nothing to do: later turns are scored as consistently as the first",
    )


def corrections_step(record: RunRecord, precision: str | None) -> NextStep | None:
    """The correction that keeps the most data among those whose kept K3 is within this run's K3 noise
    (the relative half-width of its 95% interval) of the lowest kept K3; none needed when no
    correction lowers K3 by more than that noise, or K3 is already inside the published range."""
    c = record.corrections or {}
    kept = {k: c.get(KEPT_K3[k]) for k in CORRECTION_KEYS}
    known = {
        k: (float(v), float(c[k]))
        for k, v in kept.items()
        if isinstance(v, int | float) and math.isfinite(v) and isinstance(c.get(k), int | float)
    }
    interval = k3_interval(record)
    # an infinite K3 (a sampled token the reference gives p = 0) has no noise to judge a correction by
    if not known or interval is None or not all(map(math.isfinite, interval)) or not interval[0]:
        return None
    estimate, low, high = interval
    noise = max(high - estimate, estimate - low) / estimate  # relative half-width: the run's own noise
    best_k3 = min(v for v, _ in known.values())
    within = {k: v for k, v in known.items() if v[0] <= best_k3 * (1 + noise)}
    choice = min(within, key=lambda k: (within[k][1], within[k][0]))
    k3_kept, share = within[choice]
    label = CORRECTION_DOCS[choice].label
    thresholds = ", ".join(f"{k} {fmt(v)}" for k, v in (c.get("thresholds") or {}).get(choice, {}).items())
    if estimate <= best_k3 * (1 + noise):
        return NextStep(
            "corrections",
            f"no correction lowers K3 by more than this run's noise (±{pct(noise)}): the lowest K3 a correction "
            f"keeps is {fmt(best_k3)} ({CORRECTION_DOCS[min(known, key=lambda k: known[k][0])].label}) against "
            f"{fmt(estimate)} for all tokens",
            "none needed on this evidence; a correction here would cost data for no measurable gain",
        )
    _, top, _ = published_k3_range(precision)
    finding = (
        f"{label} keeps K3 {fmt(k3_kept)} (all tokens: {fmt(estimate)}) at a cost of {pct(share)} of the data; "
        f"the lowest K3 any correction keeps is {fmt(best_k3)}, and this run's K3 noise is ±{pct(noise)}"
    )
    if estimate <= top:
        return NextStep(
            "corrections",
            finding,
            f"none needed: K3 is already at or below the top of the published range; if you correct anyway, {label} "
            f"({thresholds}) keeps the most data of the corrections within that noise of the best",
        )
    return NextStep(
        "corrections",
        finding,
        f"{label} ({thresholds}, this run's [corrections]) keeps the most data of the corrections within that "
        "noise of the best",
        urgent=True,
    )


def suggested_checks(record: RunRecord, run_name: str) -> list[dict[str, Any]]:
    """A gate for runs of this configuration, from this run's intervals: each bounded metric at
    estimate + sqrt(2) x its upper half-width, where a re-run of the same configuration lands below
    with ~97.5% probability (so a failure means the configuration got worse, not another sample)."""
    found = (record.intervals or {}).get("metrics") or {}
    n = (record.intervals or {}).get("n_sequences")
    checks = []
    for key, severity in GATE_METRICS.items():
        if key not in found or any(not math.isfinite(float(x)) for x in found[key]):
            continue
        estimate, low, high = (float(x) for x in found[key])
        bound = estimate + RERUN_FACTOR * (high - estimate)
        checks.append(
            {
                "name": f"{key} within this configuration's noise",
                "metric": key,
                "op": "<=",
                "threshold": round_up(bound),
                "severity": severity,
                "description": f"{run_name}: {fmt(estimate)}, 95% interval {fmt(low)}–{fmt(high)} over {n} "
                "sequences; the bound is the estimate plus sqrt(2) times the upper half-width, where a re-run "
                "of the same configuration lands below with ~97.5% probability",
                "source": f"this run's sequence bootstrap ({(record.intervals or {}).get('n_boot')} replicates)",
            }
        )
    return checks


def round_up(x: float, digits: int = 3) -> float:
    """``x`` rounded up to ``digits`` significant digits: a bound people read, never below the value
    it bounds (the run it came from passes its own gate)."""
    if x <= 0 or not math.isfinite(x):
        return x
    unit = 10.0 ** (math.floor(math.log10(x)) - digits + 1)
    return float(f"{math.ceil(x / unit - 1e-9) * unit:.{digits}g}")


def gate_step(record: RunRecord, checks: list[dict[str, Any]], gate_command: str) -> NextStep | None:
    if not checks:
        return None
    k3 = next((c for c in checks if c["metric"] == "k3_kl"), checks[0])
    return NextStep(
        "gate",
        f"this run's intervals bound {len(checks)} metrics, e.g. {k3['metric']} at {fmt(k3['threshold'])}",
        f"gate later runs of this configuration (a new engine version, a new GPU type) with {SUGGESTED_GATE}",
        gate_command,
        SUGGESTED_GATE,
    )


def _version(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in str(text).split("+")[0].split(".")[:2])
    except ValueError:
        return None


def sweep_axes(record: RunRecord, precision: str | None) -> list[Axis]:
    """The settings most likely to move K3 on this stack, each as an axis from the run's value to the
    other: the configuration's known risks first (``init``'s ``[stack]``), then cascade attention
    (vLLM before 0.32), CUDA graphs (not on a CPU, where vLLM compiles for minutes), the fp32 LM head
    on each side, the reference's dtype, the log-prob mode (when sampling is not plain), the rollout's
    precision. Only settings the engine honours (``config/spec.py: engine_settings``)."""
    spec = record.spec.to_dict()
    engine, reference, sampling = spec.get("engine") or {}, spec.get("reference") or {}, spec.get("sampling") or {}
    name = str(engine.get("name") or "")
    honoured = engine_settings(name) | COMMON_ENGINE_SETTINGS
    version = _version((record.engine.versions if record.engine else {}).get(name))
    on_cpu = str((record.environment.hardware if record.environment else "") or "").lower().startswith("cpu")
    risks = {str(r.get("id")) for r in (record.spec.stack or {}).get("risks") or []}
    axes: list[Axis] = []

    def flip(section: dict, key: str, default: bool) -> list[bool]:
        now = section.get(key.split(".", 1)[1])
        now = default if now is None else bool(now)
        return [now, not now]

    if "cascade_attn" in honoured and version is not None and version < CASCADE_REMOVED:
        axes.append(
            Axis(
                "engine.cascade_attn",
                flip(engine, "engine.cascade_attn", True),
                "cascade attention raised K3 to the A100 collapse level in published runs; vLLM "
                f"{'.'.join(map(str, version))} still has it",
            )
        )
    if "enforce_eager" in honoured and not on_cpu:
        axes.append(
            Axis(
                "engine.enforce_eager", flip(engine, "engine.enforce_eager", False), "CUDA graphs against eager kernels"
            )
        )
    axes.append(
        Axis(
            "reference.logits_fp32",
            flip(reference, "reference.logits_fp32", False),
            "the trainer's LM head in fp32 or in its dtype",
        )
    )
    if "logits_fp32" in honoured:
        axes.append(
            Axis("engine.logits_fp32", flip(engine, "engine.logits_fp32", False), "the engine's LM head in fp32")
        )
    ref_dtype = str(reference.get("dtype") or "float32")
    axes.append(
        Axis(
            "reference.dtype",
            [ref_dtype, "bfloat16" if ref_dtype == "float32" else "float32"],
            "the trainer's forward in fp32 or bf16",
        )
    )
    truncated = (sampling.get("top_p") or 1.0) < 1.0 or (sampling.get("top_k") or 0) > 0
    if "logprobs_mode" in honoured and (truncated or (sampling.get("temperature") or 1.0) != 1.0):
        mode = str(engine.get("logprobs_mode") or "raw")
        axes.append(
            Axis(
                "engine.logprobs_mode",
                [mode, "processed" if mode == "raw" else "raw"],
                "temperature or top-p/top-k: the engine's log-probs before or after them",
            )
        )
    dtype = str(engine.get("dtype") or "bfloat16")
    # a server's precision is the server's (a remote engine samples from what it was started with)
    if not engine.get("quantization") and not engine.get("checkpoint") and name != "remote":
        axes.append(
            Axis(
                "engine.dtype",
                [dtype, "float32" if dtype != "float32" else "bfloat16"],
                f"the rollout's precision ({precision or dtype}) against full precision",
            )
        )
    # the known risks of the framework's configuration first: they are what this stack already does
    risk_keys = {
        "cascade-attention": "engine.cascade_attn",
        "one-sided-fp32-head": "reference.logits_fp32",
        "precision-differs": "engine.dtype",
        "logprobs-temperature": "engine.logprobs_mode",
        "truncated-sampling": "engine.logprobs_mode",
    }
    first = {risk_keys[r] for r in risks if r in risk_keys}
    return sorted(axes, key=lambda a: a.key not in first)


def next_steps(
    record: RunRecord,
    precision: str | None,
    *,
    run_name: str,
    sweep_command: str,
    gate_command: str,
    spec_command: str,
    precision_command: str,
) -> list[NextStep]:
    """The report's "What to do next", from the run's own findings (the module docstring says which)."""
    axes = sweep_axes(record, precision)
    steps = [k3_step(record, precision, axes, sweep_command)]
    for step in (
        sample_size_step(record, precision_command),
        prefill_step(record, spec_command),
        later_turns_step(record),
        corrections_step(record, precision),
        gate_step(record, suggested_checks(record, run_name), gate_command),
    ):
        if step is not None:
            steps.append(step)
    return steps
