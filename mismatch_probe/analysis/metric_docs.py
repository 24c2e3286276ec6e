"""What each metric means, which direction is better, and the published points to read it against.

One table used by every renderer (Markdown, HTML, comparison highlighting), so a definition is
written once. Sources of the reference points:

- mismatch-KL by GPU type: Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse
  from the Training-Inference Mismatch" (2025): H20 ~5e-4..1e-3, L20 ~1e-3..1e-2, A100 up to 1e-1
  until cascade attention was disabled.
- NeMo-RL's ``token_mult_prob_error`` (mean exp|delta|) and its 1.05 threshold.
- verl's rollout correction defaults: ``rollout_is_threshold`` 2.0, geometric bounds "typically
  1.0002 - 1.001", token veto "typically 1e-4 to 1e-6".
- verl's FAQ (docs/faq/faq.rst): ``training/rollout_probs_diff_mean`` (mean |Δp|) "should be below
  0.005"; above 0.01 "indicates a precision issue".
- K3 under FP8 rollouts (``PUBLISHED_K3``): NeMo-RL's Qwen3.5 guide (PR #2744) and xtuner's FP8
  alignment fix (PR #2044); README's Precision section lists them with verl PR #7519's K1 and Pearson figures.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class MetricDoc(NamedTuple):
    key: str
    label: str
    meaning: str
    reference: str  # a published point or the ideal value; "" when there is none
    better: str | None  # "lower", "higher", "zero" (closest to 0), "one" (closest to 1), or None (not a quality)


METRIC_DOCS = (
    MetricDoc(
        "k3_kl",
        "K3 KL (mismatch-KL)",
        "mean of ratio − δ − 1 over tokens, the 'vllm-kl' of the literature; ≥ 0, 0 is perfect",
        "published: H20 ~5e-4–1e-3, L20 ~1e-3–1e-2, A100 up to 1e-1 with cascade attention",
        "lower",
    ),
    MetricDoc(
        "k1_kl",
        "K1 KL",
        "mean of −δ = logp_infer − logp_train; unbiased KL(μ‖π) estimate, can be negative",
        "0 is perfect",
        "zero",
    ),
    MetricDoc(
        "k2_kl",
        "K2 KL",
        "mean of δ² / 2; ≥ 0, a low-variance KL estimate, biased, that agrees with KL to second order in δ",
        "0 is perfect",
        "lower",
    ),
    MetricDoc("abs_delta_mean", "mean |δ|", "mean |logp_train − logp_infer|", "0 is perfect", "lower"),
    MetricDoc("abs_delta_p50", "median |δ|", "50th percentile of |δ| over tokens", "0 is perfect", "lower"),
    MetricDoc("abs_delta_p90", "p90 |δ|", "90th percentile of |δ| over tokens", "0 is perfect", "lower"),
    MetricDoc("abs_delta_p99", "p99 |δ|", "99th percentile of |δ| over tokens", "0 is perfect", "lower"),
    MetricDoc(
        "abs_delta_max", "max |δ|", "largest |δ| of any sampled token (inf when p_train = 0)", "0 is perfect", "lower"
    ),
    MetricDoc(
        "prob_diff_mean",
        "mean |Δp|",
        "mean |p_train − p_infer|, the TIS paper's token mismatch",
        "0 is perfect",
        "lower",
    ),
    MetricDoc("prob_diff_max", "max |Δp|", "largest |p_train − p_infer| of any sampled token", "0 is perfect", "lower"),
    MetricDoc(
        "seq_max_mismatch_mean",
        "seq max mismatch (mean)",
        "per sequence the largest |Δp|, averaged over sequences",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "seq_max_mismatch_gt_0_5_share",
        "sequences with max |Δp| > 0.5",
        "share of sequences holding a token whose probability moved by more than 0.5",
        "the parallelism study's headline number; 0 is perfect",
        "lower",
    ),
    MetricDoc(
        "seq_max_mismatch_gt_0_5_count",
        "sequences with max |Δp| > 0.5 (count)",
        "how many sequences hold a token whose probability moved by more than 0.5",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "seq_mean_mismatch_mean",
        "seq mean mismatch (mean)",
        "per sequence the mean |Δp| over its tokens, averaged over sequences (each sequence weighs the same)",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "seq_log_ratio_mean",
        "seq log-ratio (mean)",
        "mean over sequences of Σδ, the log of the sequence importance weight; signed",
        "0 is perfect",
        "zero",
    ),
    MetricDoc(
        "seq_geo_ratio_mean",
        "seq geometric-mean ratio (mean)",
        "mean over sequences of exp(Σδ / length), what geometric rejection bounds to [1 − ε, 1 + ε]",
        "1.0 is perfect; verl's geometric bounds are typically 1.0002–1.001",
        "one",
    ),
    MetricDoc(
        "seq_min_token_ratio_min",
        "smallest token ratio",
        "min over tokens of exp(δ), what worst-token rejection compares with τ",
        "1.0 is perfect; verl's token veto is typically 1e-4 to 1e-6",
        "one",
    ),
    MetricDoc(
        "mult_prob_error",
        "token mult. prob error",
        "mean exp(|δ|); 1.0 is perfect",
        "NeMo-RL's token_mult_prob_error; its threshold is 1.05",
        "lower",
    ),
    MetricDoc(
        "chi2_token",
        "χ² (token)",
        "mean(ratio²) − 1, as verl computes it: the variance of token importance weights if their mean were "
        "exactly 1; the sample mean fluctuates around 1, so near 0 this can dip below 0 (see χ² (token, s.n.))",
        "0 is perfect",
        "zero",
    ),  # a signed estimate: -6e-4 is not better than 4e-9
    MetricDoc(
        "chi2_token_sn",
        "χ² (token, s.n.)",
        "self-normalized mean(ratio²) / mean(ratio)² − 1 = 1 / ESS − 1: never negative",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "chi2_seq",
        "χ² (sequence)",
        "mean(exp(2·clamp(Σδ, ±20))) − 1, as verl computes it: the variance of sequence importance weights "
        "if their mean were 1; can dip below 0 near 0 (see χ² (sequence, s.n.))",
        "0 is perfect",
        "zero",
    ),
    MetricDoc(
        "chi2_seq_sn",
        "χ² (sequence, s.n.)",
        "self-normalized mean(W²) / mean(W)² − 1 of sequence weights W = exp(clamp(Σδ, ±20)): never negative",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "ess",
        "ESS (normalized)",
        "effective sample size of token ratios, 1 / mean((w / mean w)²)",
        "1.0 is perfect",
        "higher",
    ),
    MetricDoc(
        "pearson_prob",
        "Pearson r of token probs",
        "correlation of p_train and p_infer over tokens",
        "1.0 is perfect",
        "higher",
    ),
    MetricDoc("log_ppl_infer", "log-ppl (engine)", "mean over sequences of −mean(logp_infer)", "", None),
    MetricDoc("log_ppl_train", "log-ppl (reference)", "mean over sequences of −mean(logp_train)", "", None),
    MetricDoc(
        "log_ppl_diff_mean",
        "log-ppl difference (mean)",
        "mean over sequences of log-ppl (reference) − log-ppl (engine); signed",
        "0 is perfect",
        "zero",
    ),
    MetricDoc(
        "log_ppl_abs_diff_mean",
        "|log-ppl difference| (mean)",
        "mean over sequences of |log-ppl (reference) − log-ppl (engine)|",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "pearson_log_ppl",
        "Pearson r of log-ppl",
        "correlation of the per-sequence log-ppls of the two sides",
        "1.0 is perfect",
        "higher",
    ),
    MetricDoc(
        "n_zero_prob_train",
        "tokens with p_train = 0",
        "sampled tokens the reference gives probability 0 (δ = −inf, K3 = inf)",
        "0 is perfect",
        "lower",
    ),
    MetricDoc(
        "n_model_tokens", "model tokens", "tokens the policy generated; prompt and tool tokens are excluded", "", None
    ),
    MetricDoc(
        "n_sequences", "sequences", "sequences with at least one model token (sample-turns per turn group)", "", None
    ),
)
METRIC_DOC = {d.key: d for d in METRIC_DOCS}

CORRECTION_DOCS = {
    "token_tis_clipped_share": ("token TIS", "tokens whose ratio exceeds C and gets clipped to C"),
    "token_mask_share": ("token mask (IcePop)", "tokens whose ratio falls outside [low, high] and get masked"),
    "seq_tis_clipped_share": ("sequence TIS", "sequences whose sequence ratio exceeds C and gets clipped"),
    "seq_mis_masked_share": ("sequence MIS", "sequences whose sequence ratio exceeds C and get masked"),
    "geo_rejected_share": ("geometric rejection", "sequences whose geometric-mean ratio leaves [1 − ε, 1 + ε]"),
    "worst_token_rejected_share": ("worst-token rejection", "sequences holding a token with ratio below τ"),
}
KEPT_K3_MEANING = (
    "is it back near a bf16 run's K3, and at what share of the data? A token correction keeps the tokens it "
    "does not clip or mask; a sequence correction keeps every token of the sequences it does not drop"
)


def negative_chi2_note(record: dict) -> str | None:
    """Why the run's chi-square estimates are negative, when one is (all tokens, and the turn
    groups of a multi-turn run)."""
    by_turn = record.get("metrics_by_turn") or {}
    groups = [("", record.get("metrics"))]
    if (by_turn.get("later") or {}).get("n_model_tokens"):  # else "first turns" is all of them again
        groups += [(" (first turns)", by_turn.get("first")), (" (later turns)", by_turn.get("later"))]
    negative = []
    for where, metrics in groups:
        for key in ("chi2_token", "chi2_seq"):
            value = (metrics or {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                negative.append(f"{key}{where} = {value:.3g}")
    if not negative:
        return None
    return (
        f"{', '.join(negative)}: below 0, and not a bug. chi2_token and chi2_seq are mean(w²) − 1 as verl "
        "computes them, which assumes the importance weights w average exactly 1; their sample mean "
        "fluctuates around 1, so when the true value is near 0 the estimate can land below it. "
        "chi2_token_sn and chi2_seq_sn (mean(w²) / mean(w)² − 1) cannot go negative."
    )


class PublishedK3(NamedTuple):
    """A K3 a team published for rollouts of one precision (K3 as this tool computes it: the mean
    of r − 1 − log r over the policy's tokens), with where it was measured and its source."""

    precision: str  # what rollout_precision() calls the run's precision
    low: float
    high: float
    where: str
    source: str


# Only figures whose metric is K3 by the source's own code (README, Precision: published figures).
# verl PR #7519's FP8 figures (0.0100 -> 0.0313) are its rollout_corr/kl, which is K1 (signed), so
# they are cited in the docs and not placed on a K3 card.
PUBLISHED_K3 = (
    PublishedK3(
        "fp8",
        0.0024,
        0.0031,
        "NeMo-RL, Qwen3.5-35B-A3B, blockwise FP8 vLLM rollouts and FP8 Megatron training, over 126 steps",
        "NVIDIA-NeMo/RL PR #2744, docs/guides/models/qwen/qwen3-5.md (train/gen_kl_error)",
    ),
    PublishedK3(
        "fp8",
        3.7e-4,
        8.7e-3,
        "xtuner, Qwen3.5-35B-A3B FP8 rollouts at step 2: 8.7e-3 with train and rollout quantizing "
        "differently, 3.7e-4 once aligned",
        "InternLM/xtuner PR #2044 (mismatch/mismatch_k3_kl)",
    ),
)
# What a rollout precision with no verified K3 figure says instead.
UNPUBLISHED = {
    "fp16": "arXiv 2510.26788 shows FP16 on both sides shrinking the mismatch (its Figure 5) but "
    "publishes no K3: compare with a bf16 run of this model (probes/precision.toml)",
}


# The published per-GPU mismatch-KL ranges (the seeds' figures: H20 and L20 runs, A100 with cascade
# attention on), lowest first: (where, low, high). The report's K3 card and the timeline's K3
# figure read them from here.
K3_BY_GPU = (("H20", 5e-4, 1e-3), ("L20", 1e-3, 1e-2), ("A100, cascade attention", 1e-2, 1e-1))
# verl's FAQ (docs/faq/faq.rst): training/rollout_probs_diff_mean "should be below 0.005"; above 0.01
# "indicates a precision issue"
VERL_PROB_DIFF_EXPECTED, VERL_PROB_DIFF_ISSUE = 0.005, 0.01
# NeMo-RL's token_mult_prob_error threshold (1.0 is perfect agreement)
NEMO_RL_MULT_ERROR_THRESHOLD = 1.05


def k3_context(value, precision: str | None = None) -> str:
    """One line placing a mismatch-KL among the published per-GPU ranges, and for a quantized or
    fp16 rollout (``precision``, see ``report.labels.rollout_precision``) among the figures
    published for that precision."""
    if value is None:
        return ""
    if isinstance(value, str) or math.isinf(value):
        return "infinite: the reference gives some sampled token probability 0 (see n_zero_prob_train)"
    (_, h20_low, h20_high), (_, l20_low, l20_high), (_, _, a100_high) = (
        (where, _sci(low), _sci(high)) for where, low, high in K3_BY_GPU
    )
    if value < K3_BY_GPU[0][1]:
        line = f"below the published H20 range ({h20_low}–{h20_high})"
    elif value < K3_BY_GPU[0][2]:
        line = f"inside the published H20 range ({h20_low}–{h20_high})"
    elif value < K3_BY_GPU[1][2]:
        line = f"inside the published L20 range ({l20_low}–{l20_high}), where runs without correction collapsed"
    else:
        line = f"at the level published for A100 with cascade attention on (up to {a100_high}), where runs collapsed"
    if precision is None or precision == "bf16":
        return line
    published = [f for f in PUBLISHED_K3 if f.precision == precision]
    if not published:
        return f"{line}; {UNPUBLISHED.get(precision, f'no published K3 for {precision} rollouts was found')}"

    def where(f: PublishedK3) -> str:
        place = "below" if value < f.low else "above" if value > f.high else "inside"
        return f"{place} {fmt_range(f.low, f.high)} ({f.where})"

    return f"{line}; for {precision} rollouts: " + "; ".join(where(f) for f in published)


def prob_diff_context(mean) -> str:
    """Where a mean |Δp| sits against verl's FAQ (docs/faq/faq.rst): training/rollout_probs_diff_mean
    "should be below 0.005", and above 0.01 "indicates a precision issue"."""
    if mean is None or isinstance(mean, str):
        return ""
    if mean < VERL_PROB_DIFF_EXPECTED:
        return f"below verl's expected {VERL_PROB_DIFF_EXPECTED:g}"
    if mean <= VERL_PROB_DIFF_ISSUE:
        return f"above verl's expected {VERL_PROB_DIFF_EXPECTED:g}"
    return f"above {VERL_PROB_DIFF_ISSUE:g}, which verl's FAQ reads as a precision issue"


def _sci(x: float) -> str:
    """1e-3 as the literature writes it, "1e-3" (not Python's "1e-03")."""
    mantissa, _, exponent = f"{x:.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def fmt_range(low: float, high: float) -> str:
    return f"{low:.2g}–{high:.2g}"


def rank(values: list, better: str | None) -> tuple[set[int], set[int]]:
    """Indices of the best and of the worst values (None and NaN are skipped; ties share a place).
    Empty when fewer than two values are comparable or all of them are equal."""
    if better is None:
        return set(), set()
    scored = []
    for i, v in enumerate(values):
        if isinstance(v, str):
            v = float(v)  # "inf" / "-inf" as stored in run.json
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        score = {"lower": v, "higher": -v, "zero": abs(v), "one": abs(v - 1.0)}[better]
        scored.append((score, i))
    if len(scored) < 2:
        return set(), set()
    lo, hi = min(s for s, _ in scored), max(s for s, _ in scored)
    if lo == hi:
        return set(), set()
    return {i for s, i in scored if s == lo}, {i for s, i in scored if s == hi}
