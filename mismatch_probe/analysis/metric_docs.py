"""What each metric means, which direction is better, and the published points to read it against.

One table used by every renderer (Markdown, HTML, comparison highlighting), so a definition is
written once. The published figures are one table too, :data:`PUBLISHED` (each with its source):
the metrics' "read against" lines, the report's placement of a run (:func:`k3_context`,
:func:`prob_diff_context`), the timeline's reference bands and the docs' "Published figures" are
all read from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from mismatch_probe.record import RunRecord


class MetricDoc(NamedTuple):
    """One metric's entry. ``meaning`` is the short line the reports show beside the value;
    ``formula``, ``estimates`` and ``behaviour`` are its full definition on the generated metrics page
    (docs/concepts/metrics.md), in plain Unicode with δ_t = logp_train(t) − logp_infer(t),
    r_t = exp(δ_t) = p_train / p_infer and p = exp(logp) over the model tokens t (prompt and tool tokens
    excluded), μ the engine's sampling distribution and π the trainer's. A group without model tokens
    gives None for every value (0 for the counts)."""

    key: str
    label: str
    meaning: str
    reference: str  # a published point or the ideal value; "" when there is none
    better: str | None  # "lower", "higher", "zero" (closest to 0), "one" (closest to 1), or None (not a quality)
    formula: str  # exactly as analysis/metrics.py computes it: which average, clamps, ±inf, quantile method
    estimates: str  # the population quantity it estimates
    behaviour: str  # bias, sign, ideal value, behaviour near 0, outliers, dependence on length


class Published(NamedTuple):
    """A figure a source published for a metric this tool computes the same way, or a bound a
    framework reads that metric against."""

    metric: str  # the key it is read against (METRIC_DOC)
    # how it is read: "gpu", the range of bf16 rollouts on that GPU (``where``); "precision", the
    # range of rollouts of ``precision``; "expected" / "issue", a value below which a framework
    # expects it and above which it sees a problem; "threshold"; "typical", a correction's usual bounds
    role: Literal["gpu", "precision", "expected", "issue", "threshold", "typical"]
    low: float
    high: float  # = low for a single value
    where: str  # where and how it was measured, or what the bound is
    source: str
    precision: str = "bf16"  # the rollouts' precision, as report.labels.rollout_precision names it


_LIU_LI = (
    "Liu, Li et al., *When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch* (2025)"
)
# Only K3 figures whose metric is K3 by the source's own code (docs/how-to/precision.md: published
# figures). verl PR #7519's FP8 figures (0.0100 -> 0.0313) are its rollout_corr/kl, which is K1
# (signed), so they are cited in the docs and not placed on a K3 card. The per-GPU ranges are the
# seeds' figures: H20 and L20 runs, A100 with cascade attention on (until it was disabled), lowest first.
PUBLISHED = (
    Published("k3_kl", "gpu", 5e-4, 1e-3, "H20", _LIU_LI),
    Published("k3_kl", "gpu", 1e-3, 1e-2, "L20", _LIU_LI),
    Published("k3_kl", "gpu", 1e-2, 1e-1, "A100, cascade attention", _LIU_LI),
    Published(
        "k3_kl",
        "precision",
        0.0024,
        0.0031,
        "NeMo-RL, Qwen3.5-35B-A3B, blockwise FP8 vLLM rollouts and FP8 Megatron training, over 126 steps",
        "NVIDIA-NeMo/RL PR #2744, docs/guides/models/qwen/qwen3-5.md (train/gen_kl_error: K3 under NeMo-RL's default reference_policy_kl_type k3)",
        precision="fp8",
    ),
    Published(
        "k3_kl",
        "precision",
        3.7e-4,
        8.7e-3,
        "xtuner, Qwen3.5-35B-A3B FP8 rollouts at step 2: 8.7e-3 with train and rollout quantizing "
        "differently, 3.7e-4 once aligned",
        "InternLM/xtuner PR #2044 (mismatch/mismatch_k3_kl)",
        precision="fp8",
    ),
    Published(
        "prob_diff_mean",
        "expected",
        0.005,
        0.005,
        "mean |Δp| expected",
        "verl, docs/faq/faq.rst (`training/rollout_probs_diff_mean`)",
    ),
    Published(
        "prob_diff_mean", "issue", 0.01, 0.01, "mean |Δp| that indicates a precision issue", "verl, docs/faq/faq.rst"
    ),
    Published(
        "mult_prob_error",
        "threshold",
        1.05,
        1.05,
        "token mult. prob error threshold",
        "NeMo-RL (`token_mult_prob_error`)",
    ),
    Published(
        "seq_geo_ratio_mean",
        "typical",
        1.0002,
        1.001,
        "geometric rejection bounds 1 + ε",
        "verl, rollout correction (geometric RS thresholds)",
    ),
    Published(
        "seq_min_token_ratio_min",
        "typical",
        1e-6,
        1e-4,
        "token veto threshold τ",
        "verl, rollout correction (token veto)",
    ),
)


def published(metric: str, role: str) -> tuple[Published, ...]:
    """The figures :data:`PUBLISHED` holds for ``metric`` read as ``role``."""
    return tuple(f for f in PUBLISHED if f.metric == metric and f.role == role)


# derived views of the table, as the report, the timeline and the docs read them
PUBLISHED_K3 = published("k3_kl", "precision")
K3_BY_GPU = tuple((f.where, f.low, f.high) for f in published("k3_kl", "gpu"))  # (where, low, high), lowest first
(VERL_PROB_DIFF_EXPECTED,) = (f.low for f in published("prob_diff_mean", "expected"))
(VERL_PROB_DIFF_ISSUE,) = (f.low for f in published("prob_diff_mean", "issue"))
(NEMO_RL_MULT_ERROR_THRESHOLD,) = (f.low for f in published("mult_prob_error", "threshold"))
(_GEO_BOUNDS,) = published("seq_geo_ratio_mean", "typical")
(_TOKEN_VETO,) = published("seq_min_token_ratio_min", "typical")


def _sci(x: float) -> str:
    """1e-3 as the literature writes it, "1e-3" (not Python's "1e-03")."""
    mantissa, _, exponent = f"{x:.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def _k3_by_gpu_reference() -> str:
    """The per-GPU ranges as the metrics' "read against" line quotes them; a range measured under a
    condition (A100 with cascade attention) by its upper end, as the paper reports it."""
    parts = []
    for where, low, high in K3_BY_GPU:
        gpu, _, condition = where.partition(", ")
        parts.append(f"{gpu} up to {_sci(high)} with {condition}" if condition else f"{gpu} ~{_sci(low)}–{_sci(high)}")
    return "published: " + ", ".join(parts)


# the |δ| quantiles, one rule for the three (analysis/order_stats.py reproduces numpy.quantile's "linear")
_QUANTILE = (
    "of |δ_t| over the group's N model tokens, each |δ_t| rounded to float32 and the order statistics selected "
    "exactly (radix selection, no sort), then linear interpolation as numpy.quantile's default 'linear' method "
    "(Hyndman–Fan type 7): with x_(0) ≤ … ≤ x_(N−1) and h = (N − 1)·q, x_(⌊h⌋) + (h − ⌊h⌋)·(x_(⌊h⌋+1) − x_(⌊h⌋)); "
    "+inf when an infinite |δ_t| (p_train = 0) gets a nonzero weight."
)

METRIC_DOCS = (
    MetricDoc(
        key="k3_kl",
        label="K3 KL (mismatch-KL)",
        meaning="mean of ratio − δ − 1 over tokens, the 'vllm-kl' of the literature; ≥ 0, 0 is perfect",
        reference=_k3_by_gpu_reference(),
        better="lower",
        formula="(1/N) Σ_t (r_t − 1 − δ_t), a mean over the group's N model tokens (a sequence weighs by its "
        "length), each term computed in float64 as expm1(δ_t) − δ_t so tiny δ keep their precision; a token with "
        "p_train = 0 (δ_t = −inf) makes it +inf.",
        estimates="KL(μ‖π) per token, E_μ[r − 1 − log r] (Schulman's k3): the tokens are sampled from μ, the engine's "
        "sampling distribution, and π is the trainer's; averaged over the sampled positions.",
        behaviour="Unbiased when π has no mass outside μ's support (otherwise it estimates KL(μ‖π) minus that mass, "
        "e.g. under top-p/top-k), and every term is ≥ 0, so it is never negative; 0 is perfect, and near 0 it is "
        "≈ mean δ²/2, second order in the mismatch, with low variance. Its tails are lopsided: a token with "
        "p_train ≫ p_infer adds ≈ r_t/N (exponential in δ_t), one with p_train ≪ p_infer only ≈ (|δ_t| − 1)/N, "
        "and p_train = 0 makes it inf.",
    ),
    MetricDoc(
        key="k1_kl",
        label="K1 KL",
        meaning="mean of −δ = logp_infer − logp_train; unbiased KL(μ‖π) estimate, can be negative",
        reference="0 is perfect",
        better="zero",
        formula="(1/N) Σ_t (−δ_t) = (1/N) Σ_t (logp_infer(t) − logp_train(t)), a mean over the group's N model "
        "tokens in float64; +inf when any token has p_train = 0.",
        estimates="KL(μ‖π) per token as E_μ[log μ/π] (Schulman's k1), μ the engine's sampling distribution and π "
        "the trainer's.",
        behaviour="Unbiased (with no support caveat) but high-variance: its terms are first order in δ while its "
        "mean is second order (≈ mean δ²/2), so near 0 the noise, ≈ sd(δ)/√N, dominates and it is often "
        "negative; 0 is perfect, and a sign means nothing until the value clearly exceeds that noise. An outlier "
        "adds −δ_t/N (linear), p_train = 0 makes it inf.",
    ),
    MetricDoc(
        key="k2_kl",
        label="K2 KL",
        meaning="mean of δ² / 2; ≥ 0, a low-variance KL estimate, biased, that agrees with KL to second order in δ",
        reference="0 is perfect",
        better="lower",
        formula="(1/N) Σ_t δ_t² / 2, a mean over the group's N model tokens in float64; +inf when any token has "
        "p_train = 0.",
        estimates="E_μ[(log π/μ)²] / 2 (Schulman's k2), an f-divergence that equals KL(μ‖π) to second order: when "
        "E_μ[r] = 1, KL(μ‖π) = Σ_{k≥2} E_μ[δ^k] / k! = E_μ[δ²]/2 + E_μ[δ³]/6 + ….",
        behaviour="Biased for KL by −Σ_{k≥3} E_μ[δ^k] / k!, third order in δ (negligible at small mismatch, its "
        "sign following the skew of δ), and never negative; 0 is perfect, and near 0 it agrees with K3. Squared, "
        "so an outlier adds δ_t²/2N: more than K1, mean |δ| or K3 (≈ |δ_t| − 1) when p_train ≪ p_infer, far "
        "less than K3's e^δ tail when p_train ≫ p_infer.",
    ),
    MetricDoc(
        key="abs_delta_mean",
        label="mean |δ|",
        meaning="mean |logp_train − logp_infer|",
        reference="0 is perfect",
        better="lower",
        formula="(1/N) Σ_t |δ_t|, a mean over the group's N model tokens in float64; +inf when any token has "
        "p_train = 0.",
        estimates="E_μ|log π(x) − log μ(x)|: the mean absolute log-probability gap at the tokens the engine samples.",
        behaviour="Unbiased for that mean, never negative, 0 is perfect. First order in δ, so at small mismatch it "
        "reads far larger than K3 (≈ mean δ²/2), and gaps of opposite sign do not cancel as in K1; an outlier "
        "adds |δ_t|/N, so it is less outlier-driven than K3, mult. error or χ².",
    ),
    MetricDoc(
        key="abs_delta_p50",
        label="median |δ|",
        meaning="50th percentile of |δ| over tokens",
        reference="0 is perfect",
        better="lower",
        formula="The q = 0.5 quantile " + _QUANTILE,
        estimates="The median of |log π(x) − log μ(x)| over tokens sampled from μ.",
        behaviour="A consistent sample quantile (interpolation bias O(1/N)), never negative, 0 is perfect. Robust: "
        "outliers barely move it and it is inf only when about half the tokens have p_train = 0, so it shows "
        "the typical token and nothing of the tail; independent of sequence length.",
    ),
    MetricDoc(
        key="abs_delta_p90",
        label="p90 |δ|",
        meaning="90th percentile of |δ| over tokens",
        reference="0 is perfect",
        better="lower",
        formula="The q = 0.9 quantile " + _QUANTILE,
        estimates="The 90th percentile of |log π(x) − log μ(x)| over tokens sampled from μ.",
        behaviour="A consistent sample quantile (interpolation bias O(1/N)), never negative, 0 is perfect. Robust "
        "to the rarest tenth of tokens: inf only when about 10% of the tokens have p_train = 0.",
    ),
    MetricDoc(
        key="abs_delta_p99",
        label="p99 |δ|",
        meaning="99th percentile of |δ| over tokens",
        reference="0 is perfect",
        better="lower",
        formula="The q = 0.99 quantile " + _QUANTILE,
        estimates="The 99th percentile of |log π(x) − log μ(x)| over tokens sampled from μ: the tail a token in a "
        "hundred reaches.",
        behaviour="A consistent sample quantile, never negative, 0 is perfect; about N/100 tokens lie above it, so "
        "it is noisy unless N is well above a few hundred (below 100 tokens it interpolates between the largest "
        "values). Sees the tail without being set by a single token; inf once about 1% of tokens have "
        "p_train = 0.",
    ),
    MetricDoc(
        key="abs_delta_max",
        label="max |δ|",
        meaning="largest |δ| of any sampled token (inf when p_train = 0)",
        reference="0 is perfect",
        better="lower",
        formula="max_t |δ_t| over the group's N model tokens, read from the float32-rounded |δ_t| that the "
        "quantiles select from (the largest order statistic), so it carries float32 precision, unlike the "
        "float64 mean; +inf when any token has p_train = 0.",
        estimates="No fixed population quantity: the largest of N draws of |δ| under μ, which tends to the upper "
        "end of the range of |δ| as N grows.",
        behaviour="Never negative, 0 is perfect; it grows with N (batch size and sequence length), so compare runs "
        "only at equal N. Set by a single token, typically one the reference finds far less likely than the "
        "engine (p_train ≪ p_infer), since tokens with a small p_infer are rarely sampled.",
    ),
    MetricDoc(
        key="prob_diff_mean",
        label="mean |Δp|",
        meaning="mean |p_train − p_infer|, the TIS paper's token mismatch",
        reference="0 is perfect",
        better="lower",
        formula="(1/N) Σ_t |p_train(t) − p_infer(t)|, p = exp(logp) in float64, a mean over the group's N model "
        "tokens; a token with p_train = 0 adds p_infer(t), so it stays finite.",
        estimates="E_μ|π(x) − μ(x)| at the sampled token: a μ-weighted probability gap, not the total variation "
        "(TV = ½ Σ_x |π(x) − μ(x)| = ½ E_μ[|π − μ| / μ]).",
        behaviour="Unbiased for that mean, in [0, 1], never negative, 0 is perfect; first order in the gap. Each "
        "term is at most max(p_train, p_infer), so rare tokens (small p on both sides) barely count however "
        "large their log-ratio, the opposite emphasis of K3 and |δ|; mid-probability tokens dominate it.",
    ),
    MetricDoc(
        key="prob_diff_max",
        label="max |Δp|",
        meaning="largest |p_train − p_infer| of any sampled token",
        reference="0 is perfect",
        better="lower",
        formula="max_t |p_train(t) − p_infer(t)| over the group's N model tokens, in float64.",
        estimates="No fixed population quantity: the largest of N draws of |π(x) − μ(x)| under μ, which tends to "
        "the largest probability gap the sampled contexts reach.",
        behaviour="In [0, 1], 0 is perfect; it grows with N (batch size and sequence length), so compare at equal "
        "N. Set by a single token, but unlike max |δ| it ignores rare tokens (a large gap needs a probable "
        "token on one side) and stays finite when p_train = 0.",
    ),
    MetricDoc(
        key="seq_max_mismatch_mean",
        label="seq max mismatch (mean)",
        meaning="per sequence the largest |Δp|, averaged over sequences",
        reference="0 is perfect",
        better="lower",
        formula="(1/S) Σ_s max_{t∈s} |p_train(t) − p_infer(t)|: per sequence s the largest |Δp| over its n_s model "
        "tokens, then a mean over the group's S sequences, each weighing the same.",
        estimates="The expected largest per-token probability gap in a sequence sampled from μ.",
        behaviour="In [0, 1], 0 is perfect, never negative; it grows with sequence length (more tokens, more "
        "chances of a large gap), so it compares only runs of similar lengths. Bounded terms: rare tokens "
        "barely count.",
    ),
    MetricDoc(
        key="seq_max_mismatch_gt_0_5_share",
        label="sequences with max |Δp| > 0.5",
        meaning="share of sequences holding a token whose probability moved by more than 0.5",
        reference="the parallelism study's headline number; 0 is perfect",
        better="lower",
        formula="(1/S) · #{s : max_{t∈s} |p_train(t) − p_infer(t)| > 0.5} (strictly greater) over the group's S "
        "sequences, each weighing the same.",
        estimates="The probability that a sequence sampled from μ holds at least one token whose probability "
        "differs by more than 0.5 between engine and trainer.",
        behaviour="A share in [0, 1], 0 is perfect, unbiased for that probability with binomial noise "
        "√(q(1 − q)/S). It grows with sequence length (more chances), and it ignores every gap up to 0.5, so it "
        "sees only tokens that flip between likely and unlikely.",
    ),
    MetricDoc(
        key="seq_max_mismatch_gt_0_5_count",
        label="sequences with max |Δp| > 0.5 (count)",
        meaning="how many sequences hold a token whose probability moved by more than 0.5",
        reference="0 is perfect",
        better="lower",
        formula="#{s : max_{t∈s} |p_train(t) − p_infer(t)| > 0.5} (strictly greater), an integer; 0, not None, "
        "for a group without model tokens.",
        estimates="S times the probability of the share above: how many of this batch's sequences hold such a token.",
        behaviour="A count ≥ 0, 0 is perfect; it grows with the number of sequences S and with their length, so "
        "compare the share between runs of different sizes.",
    ),
    MetricDoc(
        key="seq_mean_mismatch_mean",
        label="seq mean mismatch (mean)",
        meaning="per sequence the mean |Δp| over its tokens, averaged over sequences (each sequence weighs the same)",
        reference="0 is perfect",
        better="lower",
        formula="(1/S) Σ_s (1/n_s) Σ_{t∈s} |p_train(t) − p_infer(t)|: per sequence the mean |Δp| over its n_s model "
        "tokens, then a mean over the S sequences, each weighing the same (prob_diff_mean weighs each token).",
        estimates="E_μ|π(x) − μ(x)| per token with every sampled sequence weighing the same: the expected "
        "per-sequence mean probability gap.",
        behaviour="In [0, 1], never negative, 0 is perfect; a mean, not a max, so not driven up by length, but "
        "the tokens of short sequences weigh more than in prob_diff_mean and the two differ when mismatch varies "
        "with length. Bounded terms: rare tokens barely count.",
    ),
    MetricDoc(
        key="seq_log_ratio_mean",
        label="seq log-ratio (mean)",
        meaning="mean over sequences of Σδ, the log of the sequence importance weight; signed",
        reference="0 is perfect",
        better="zero",
        formula="(1/S) Σ_s L_s with L_s = Σ_{t∈s} δ_t (not clamped) over the n_s model tokens of sequence s, a "
        "mean over the S sequences; the same sum as K1's, so it equals −k1_kl · N/S exactly; −inf when any "
        "token has p_train = 0.",
        estimates="E_μ[log π(y)/μ(y)] over whole sequences y, which is −KL(μ‖π) of the sequence distributions "
        "(the per-token KLs summed along a sequence).",
        behaviour="Signed and unbiased for −KL, so its expectation is ≤ 0: typically negative, positive only by "
        "noise; 0 is perfect. Its magnitude grows about linearly with sequence length (it sums n_s token terms) "
        "and its noise like √n_s; high-variance like K1.",
    ),
    MetricDoc(
        key="seq_geo_ratio_mean",
        label="seq geometric-mean ratio (mean)",
        meaning="mean over sequences of exp(Σδ / length), what geometric rejection bounds to [1 − ε, 1 + ε]",
        reference=f"1.0 is perfect; verl's geometric bounds are typically {_GEO_BOUNDS.low:g}–{_GEO_BOUNDS.high:g}",
        better="one",
        formula="(1/S) Σ_s exp(L_s / n_s) with L_s = Σ_{t∈s} δ_t (not clamped): per sequence the geometric mean of "
        "r_t over its n_s model tokens, then a mean over the S sequences; a sequence with a p_train = 0 token "
        "contributes 0.",
        estimates="E_μ[(π(y)/μ(y))^(1/n)] over sequences y of n tokens: the typical per-token sequence weight "
        "that verl's geometric rejection bounds.",
        behaviour="1 is perfect; biased below 1 as mismatch grows, by ≈ (1 − 1/n_s)·k3_kl for independent tokens "
        "(exactly 1 in expectation at n_s = 1). Deviations above and below 1 cancel in the mean, so it can sit "
        "near 1 while single sequences leave [1 − ε, 1 + ε] (see geo_rejected_share).",
    ),
    MetricDoc(
        key="seq_min_token_ratio_min",
        label="smallest token ratio",
        meaning="min over tokens of exp(δ), what worst-token rejection compares with τ",
        reference=f"1.0 is perfect; verl's token veto is typically {_sci(_TOKEN_VETO.high)} to {_sci(_TOKEN_VETO.low)}",
        better="one",
        formula="exp(min_t δ_t) = min_t r_t over every model token of the group (the minimum taken on δ, then "
        "exponentiated); 0 when any token has p_train = 0.",
        estimates="No fixed population quantity: the smallest of N draws of r under μ, the low end of the token "
        "ratio's range that verl's token veto compares with τ.",
        behaviour="1 is perfect; in practice in [0, 1] (above 1 only if every token has p_train > p_infer), and it "
        "falls toward 0 as N (batch size and sequence length) grows, so compare at equal N. Set by a single "
        "token, the one the reference finds least likely relative to the engine.",
    ),
    MetricDoc(
        key="mult_prob_error",
        label="token mult. prob error",
        meaning="mean exp(|δ|); 1.0 is perfect",
        reference=f"NeMo-RL's token_mult_prob_error; its threshold is {NEMO_RL_MULT_ERROR_THRESHOLD:g}",
        better="lower",
        formula="(1/N) Σ_t exp(|δ_t|) = (1/N) Σ_t max(r_t, 1/r_t), a mean over the group's N model tokens in "
        "float64; +inf when any token has p_train = 0.",
        estimates="E_μ[max(π/μ, μ/π)] per token: the mean multiplicative probability error at the tokens the "
        "engine samples.",
        behaviour="≥ 1, 1 is perfect; near 1 it is ≈ 1 + mean |δ| + mean δ²/2, first order in δ like mean |δ|. "
        "Exponential in |δ|: one token with |δ_t| = 10 adds e^10/N ≈ 2.2e4/N, so rare outlier tokens in either "
        "direction dominate it.",
    ),
    MetricDoc(
        key="chi2_token",
        label="χ² (token)",
        meaning="mean(ratio²) − 1, as verl computes it: the variance of token importance weights if their mean were "
        "exactly 1; the sample mean fluctuates around 1, so near 0 this can dip below 0 (see χ² (token, s.n.))",
        reference="0 is perfect",
        better="zero",
        formula="(1/N) Σ_t r_t² − 1, a mean over the group's N model tokens in float64, not clamped (verl's form); "
        "a token with p_train = 0 has r_t = 0 and adds −1/N, so it stays finite.",
        estimates="χ²(π‖μ) = E_μ[r²] − 1 = Σ_x π(x)²/μ(x) − 1 per token, when π has no mass outside μ's support: "
        "the variance under μ of the token importance weight r, whose mean is then 1.",
        behaviour="Unbiased for E_μ[r²] − 1, but the sample mean of r fluctuates around 1, so near 0 it can come "
        "out negative (−6e-4 is no better than 4e-9: read chi2_token_sn there); 0 is perfect. Heavy-tailed: a "
        "token with p_train ≫ p_infer adds r_t²/N, so one rare token (small p_infer) can dominate it.",
    ),  # a signed estimate: -6e-4 is not better than 4e-9
    MetricDoc(
        key="chi2_token_sn",
        label="χ² (token, s.n.)",
        meaning="self-normalized mean(ratio²) / mean(ratio)² − 1 = 1 / ESS − 1: never negative",
        reference="0 is perfect",
        better="lower",
        formula="(1/N) Σ_t (r_t − r̄)² / r̄² with r̄ = (1/N) Σ_t r_t over the group's N model tokens, i.e. "
        "mean(r²)/mean(r)² − 1 = 1/ess − 1, computed from squared deviations (co-moments merged exactly across "
        "shards) so it cannot round below 0; None when r̄ = 0 (every token has p_train = 0).",
        estimates="χ²(π‖μ) per token, self-normalized: the squared coefficient of variation of the token importance "
        "weights, which does not assume their mean is 1.",
        behaviour="Never negative, 0 only when every r_t is equal; a ratio estimator, consistent with a bias of "
        "order 1/N, and the one to read near 0. At most N − 1 (one token holding all the weight), so with "
        "heavy-tailed r it saturates instead of exploding; still driven by the largest r_t.",
    ),
    MetricDoc(
        key="chi2_seq",
        label="χ² (sequence)",
        meaning="mean(exp(2·clamp(Σδ, ±20))) − 1, as verl computes it: the variance of sequence importance weights "
        "if their mean were 1; can dip below 0 near 0 (see χ² (sequence, s.n.))",
        reference="0 is perfect",
        better="zero",
        formula="(1/S) Σ_s W_s² − 1 with W_s = exp(clamp(L_s, −20, 20)) and L_s = Σ_{t∈s} δ_t over the n_s model "
        "tokens of sequence s, a mean over the S sequences, each weighing the same (verl's form and clamp); a "
        "p_train = 0 token gives L_s = −inf, clamped to −20.",
        estimates="χ²(π‖μ) of whole sequences, E_μ[W²] − 1 for the sequence importance weight W = π(y)/μ(y), with "
        "W capped to [e^−20, e^20].",
        behaviour="Unbiased for E_μ[W²] − 1 up to the clamp (which biases it down once some L_s > 20) and, like "
        "chi2_token, it can dip below 0 near 0; 0 is perfect. It grows exponentially with sequence length "
        "((1 + χ²_token)^n − 1 for independent tokens) and is dominated by the sequence with the largest L_s, "
        "up to e^40/S from one sequence.",
    ),
    MetricDoc(
        key="chi2_seq_sn",
        label="χ² (sequence, s.n.)",
        meaning="self-normalized mean(W²) / mean(W)² − 1 of sequence weights W = exp(clamp(Σδ, ±20)): never negative",
        reference="0 is perfect",
        better="lower",
        formula="(1/S) Σ_s (W_s − W̄)² / W̄² with W_s = exp(clamp(L_s, −20, 20)), L_s = Σ_{t∈s} δ_t and "
        "W̄ = (1/S) Σ_s W_s, i.e. mean(W²)/mean(W)² − 1 over the S sequences (each weighing the same), computed "
        "from squared deviations.",
        estimates="χ²(π‖μ) of whole sequences, self-normalized: the squared coefficient of variation of the "
        "clamped sequence weights, S/ESS_seq − 1 with ESS_seq = (Σ_s W_s)² / Σ_s W_s².",
        behaviour="Never negative, 0 only when every W_s is equal; consistent with a bias of order 1/S. At most "
        "S − 1 (one sequence holding all the weight), which long sequences with mismatch approach quickly since "
        "W is a product over n_s tokens, so it saturates near S − 1 rather than growing without bound.",
    ),
    MetricDoc(
        key="ess",
        label="ESS (normalized)",
        meaning="effective sample size of token ratios, 1 / mean((w / mean w)²)",
        reference="1.0 is perfect",
        better="higher",
        formula="(Σ_t r_t)² / (N · Σ_t r_t²) = 1 / mean((r/r̄)²) = 1/(1 + chi2_token_sn) over the group's N model "
        "tokens, in float64; None when Σ_t r_t² = 0 (every token has p_train = 0).",
        estimates="The normalized effective sample size of the token importance weights, ≈ 1/(1 + χ²(π‖μ)): the "
        "share of the N tokens an importance-weighted estimate of an expectation under π effectively uses.",
        behaviour="In [1/N, 1], 1 is perfect (all r_t equal); a ratio estimator, consistent with a bias of order "
        "1/N. Pulled down by the few tokens with the largest r_t (p_train ≫ p_infer); token-level and "
        "normalized, so it does not depend on sequence length.",
    ),
    MetricDoc(
        key="pearson_prob",
        label="Pearson r of token probs",
        meaning="correlation of p_train and p_infer over tokens",
        reference="1.0 is perfect",
        better="higher",
        formula="Σ_t (p_train(t) − p̄_train)(p_infer(t) − p̄_infer) / √(Σ_t (p_train(t) − p̄_train)² · "
        "Σ_t (p_infer(t) − p̄_infer)²) over the group's N model tokens (co-moments merged exactly across "
        "shards); None for fewer than 2 tokens or a constant side.",
        estimates="The correlation between π(x) and μ(x) at tokens sampled from μ.",
        behaviour="In [−1, 1], 1 is perfect; a sample correlation, consistent with a bias of order 1/N. Driven by "
        "the spread of probabilities over [0, 1], so it stays near 1 (0.999 against 0.9999) with mismatch that "
        "matters, ignores rare tokens, and reads 1 under any affine distortion p_train = a + b·p_infer (b > 0).",
    ),
    MetricDoc(
        key="log_ppl_infer",
        label="log-ppl (engine)",
        meaning="mean over sequences of −mean(logp_infer)",
        reference="",
        better=None,
        formula="(1/S) Σ_s (−(1/n_s) Σ_{t∈s} logp_infer(t)): per sequence the mean negative log-probability of its "
        "n_s model tokens under the engine, then a mean over the S sequences, each weighing the same.",
        estimates="The engine's per-token entropy H(μ) (its expected −log μ of its own samples), every sampled "
        "sequence weighing the same; not a mismatch.",
        behaviour="Not a quality: ≥ 0, set by the model, the prompts and the sampling settings; context for the "
        "other values, since mismatch is usually larger at higher entropy. Unbiased for the per-sequence mean; "
        "the tokens of short sequences weigh more than in a token average.",
    ),
    MetricDoc(
        key="log_ppl_train",
        label="log-ppl (reference)",
        meaning="mean over sequences of −mean(logp_train)",
        reference="",
        better=None,
        formula="(1/S) Σ_s (−(1/n_s) Σ_{t∈s} logp_train(t)), each sequence weighing the same; +inf when any "
        "token has p_train = 0.",
        estimates="The cross-entropy H(μ, π) = H(μ) + KL(μ‖π) per token: how well the trainer predicts the "
        "engine's samples, every sampled sequence weighing the same.",
        behaviour="Not a quality on its own: ≥ 0, and above log_ppl_infer by a sequence-weighted KL(μ‖π) in "
        "expectation (log_ppl_diff_mean); one p_train = 0 token makes it inf.",
    ),
    MetricDoc(
        key="log_ppl_diff_mean",
        label="log-ppl difference (mean)",
        meaning="mean over sequences of log-ppl (reference) − log-ppl (engine); signed",
        reference="0 is perfect",
        better="zero",
        formula="(1/S) Σ_s (1/n_s) Σ_{t∈s} (−δ_t) = log_ppl_train − log_ppl_infer: per sequence the mean of K1's "
        "terms, then a mean over the S sequences, each weighing the same; +inf when any token has p_train = 0.",
        estimates="KL(μ‖π) per token with every sampled sequence weighing the same: a sequence-weighted K1 "
        "(k1_kl weighs each token the same).",
        behaviour="Unbiased and high-variance like K1: signed, often negative by noise near 0, 0 is perfect. Per "
        "sequence it is −log of the geometric-mean ratio, the log-space counterpart of seq_geo_ratio_mean.",
    ),
    MetricDoc(
        key="log_ppl_abs_diff_mean",
        label="|log-ppl difference| (mean)",
        meaning="mean over sequences of |log-ppl (reference) − log-ppl (engine)|",
        reference="0 is perfect",
        better="lower",
        formula="(1/S) Σ_s |(1/n_s) Σ_{t∈s} δ_t|: per sequence the absolute log-ppl difference (|log| of its "
        "geometric-mean ratio), then a mean over the S sequences, each weighing the same; +inf when any token "
        "has p_train = 0.",
        estimates="The expected absolute per-token mean log-ratio of a sequence sampled from μ: how far a "
        "sequence's perplexity moves, in either direction.",
        behaviour="Never negative, 0 is perfect; biased upward against the signed difference, since each "
        "sequence's fluctuation counts whatever its sign: ≈ sd(δ)·√(2/(π·n_s)) for zero-mean independent "
        "token noise, so at a fixed per-token mismatch it falls as sequences get longer.",
    ),
    MetricDoc(
        key="pearson_log_ppl",
        label="Pearson r of log-ppl",
        meaning="correlation of the per-sequence log-ppls of the two sides",
        reference="1.0 is perfect",
        better="higher",
        formula="The Pearson correlation over the S sequences of (log_ppl_infer(s), log_ppl_train(s)), in float64, "
        "each sequence weighing the same; None for fewer than 2 sequences, a constant side, or any non-finite "
        "value (a sequence with a p_train = 0 token).",
        estimates="The correlation between engine and trainer per-sequence log-perplexity across sequences sampled "
        "from μ.",
        behaviour="In [−1, 1], 1 is perfect; a sample correlation, consistent with a bias of order 1/S. Driven by "
        "how much log-ppl varies between sequences, so it stays near 1 with per-token mismatch that matters and "
        "drops only when sequences shift relative to each other; one p_train = 0 token makes it None.",
    ),
    MetricDoc(
        key="n_zero_prob_train",
        label="tokens with p_train = 0",
        meaning="sampled tokens the reference gives probability 0 (δ = −inf, K3 = inf)",
        reference="0 is perfect",
        better="lower",
        formula="#{t : logp_train(t) = −inf} over the group's model tokens, an integer.",
        estimates="N times μ's per-token mass outside π's support: how often the engine samples a token the "
        "trainer rules out.",
        behaviour="A count ≥ 0, 0 is perfect, growing with N. Any nonzero count makes K1, K2, K3, mean and max |δ|, "
        "mult. error, log_ppl_train and the log-ppl differences inf, seq_log_ratio_mean −inf, "
        "seq_min_token_ratio_min 0 and pearson_log_ppl None (|Δp|, χ², ESS and pearson_prob stay finite). "
        "Often a semantics mismatch (processed against raw log-probs, top-p/top-k) rather than numerics.",
    ),
    MetricDoc(
        key="n_model_tokens",
        label="model tokens",
        meaning="tokens the policy generated; prompt and tool tokens are excluded",
        reference="",
        better=None,
        formula="N = the number of model tokens in the group (prompt and tool tokens excluded), an integer.",
        estimates="Not an estimate: the sample size behind every token-level value.",
        behaviour="A count, not a quality; the noise of token means shrinks like 1/√N (more slowly where the tokens "
        "of one sequence are correlated), and the maxima grow with it.",
    ),
    MetricDoc(
        key="n_sequences",
        label="sequences",
        meaning="sequences with at least one model token (sample-turns per turn group)",
        reference="",
        better=None,
        formula="S = the number of sequences with at least one model token, an integer: samples (all their turns' "
        "model tokens) in the whole run, sample-turns in the turn groups.",
        estimates="Not an estimate: the sample size behind every sequence-level value.",
        behaviour="A count, not a quality; sequence means and shares have noise of order 1/√S, and chi2_seq_sn is "
        "at most S − 1.",
    ),
)
METRIC_DOC = {d.key: d for d in METRIC_DOCS}


class CorrectionDoc(NamedTuple):
    """One correction what-if: its name, what it counts (the reports show both), and the exact rule
    ``MetricsAccumulator.corrections`` applies, for the generated metrics page."""

    label: str
    meaning: str
    formula: str  # the rule as analysis/metrics.py applies it, its thresholds named as the settings call them


CORRECTION_DOCS = {
    "token_tis_clipped_share": CorrectionDoc(
        label="token TIS",
        meaning="tokens whose ratio exceeds C and gets clipped to C",
        formula="(1/N) · #{t : r_t > C}, tested as δ_t > ln C, over the group's N model tokens; C = token_tis. "
        "Kept K3: the mean K3 term over the tokens with r_t ≤ C.",
    ),
    "token_mask_share": CorrectionDoc(
        label="token mask (IcePop)",
        meaning="tokens whose ratio falls outside [low, high] and get masked",
        formula="(1/N) · #{t : r_t < low or r_t > high}, tested as δ_t < ln low or δ_t > ln high, over the N model "
        "tokens; low = token_mask_low, high = token_mask_high; a p_train = 0 token (r_t = 0) is masked. Kept K3: "
        "the mean K3 term over the tokens with low ≤ r_t ≤ high.",
    ),
    "seq_tis_clipped_share": CorrectionDoc(
        label="sequence TIS",
        meaning="sequences whose sequence ratio exceeds C and gets clipped",
        formula="(1/S) · #{s : exp(L_s) > C}, tested as L_s = Σ_{t∈s} δ_t > ln C (not clamped), over the S "
        "sequences, each weighing the same; C = seq_tis. Kept K3: the mean K3 term over every token of the "
        "sequences with L_s ≤ ln C.",
    ),
    "seq_mis_masked_share": CorrectionDoc(
        label="sequence MIS",
        meaning="sequences whose sequence ratio exceeds C and get masked",
        formula="(1/S) · #{s : exp(L_s) > C}, tested as L_s = Σ_{t∈s} δ_t > ln C (not clamped), over the S "
        "sequences, each weighing the same; C = seq_mis (no lower bound). Kept K3: the mean K3 term over every "
        "token of the sequences with L_s ≤ ln C.",
    ),
    "geo_rejected_share": CorrectionDoc(
        label="geometric rejection",
        meaning="sequences whose geometric-mean ratio leaves [1 − ε, 1 + ε]",
        formula="(1/S) · #{s : exp(L_s/n_s) < 1 − ε or > 1 + ε}, tested as L_s/n_s < ln(1 − ε) or "
        "> ln(1 + ε) with L_s = Σ_{t∈s} δ_t over its n_s model tokens; ε = geo_eps; a sequence with a "
        "p_train = 0 token is rejected. Kept K3: the mean K3 term over every token of the sequences kept.",
    ),
    "worst_token_rejected_share": CorrectionDoc(
        label="worst-token rejection",
        meaning="sequences holding a token with ratio below τ",
        formula="(1/S) · #{s : min_{t∈s} r_t < τ}, tested as min_{t∈s} δ_t < ln τ, over the S sequences; "
        "τ = worst_token_tau; a sequence with a p_train = 0 token is rejected. Kept K3: the mean K3 term over "
        "every token of the sequences kept.",
    ),
}
KEPT_K3_MEANING = (
    "is it back near a bf16 run's K3, and at what share of the data? A token correction keeps the tokens it "
    "does not clip or mask; a sequence correction keeps every token of the sequences it does not drop"
)


def negative_chi2_note(record: RunRecord | Mapping[str, Any]) -> str | None:
    """Why the run's chi-square estimates are negative, when one is (all tokens, and the turn
    groups of a multi-turn run). ``record``: the run's, or its ``metrics`` and ``metrics_by_turn``
    sections as a mapping."""
    run = record if isinstance(record, RunRecord) else RunRecord.model_validate(dict(record))
    groups: list[tuple[str, str | None]] = [("", None)]
    if run.metric("n_model_tokens", "later"):  # else "first turns" is all of them again
        groups += [(" (first turns)", "first"), (" (later turns)", "later")]
    negative = []
    for where, group in groups:
        for key in ("chi2_token", "chi2_seq"):
            value = run.metric(key, group)
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


# What a rollout precision with no verified K3 figure says instead.
UNPUBLISHED = {
    "fp16": "arXiv 2510.26788 shows FP16 on both sides shrinking the mismatch (its Figure 5) but "
    "publishes no K3: compare with a bf16 run of this model (probes/precision.toml)",
}


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

    def where(f: Published) -> str:
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
