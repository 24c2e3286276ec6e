"""Your dashboard: each RL framework's own mismatch metrics, computed as that framework computes them,
on this run's tokens, so the number a user compares with is the one their training dashboard shows.

A framework logs the training-inference mismatch under its own names and reductions: slime averages
each sequence first, then the sequences; NeMo-RL's ``gen_kl_error`` is K3 only under its default
``reference_policy_kl_type``; prime-rl logs K3's std and max; TRL logs the importance ratio of whole
sequences after masking them. Each :class:`PeerMetric` below names the framework, the key exactly as
that framework logs it (``[...]``: a variant the framework's configuration selects, e.g. NeMo-RL's
KL type or slime's per-token reduction, named here because both are in use), its formula in the
terms of docs/concepts/metrics.md (δ_t = logp_train − logp_infer over the model tokens,
r_t = exp(δ_t); "the trainer" is this run's reference), where its code is (file:line at the commit
mismatch_probe/frameworks/<framework>.py reads), and the probe metric it equals, if any.

Everything is computed from one streamed pass (:class:`PeerAccumulator`, fed by ``analyze`` with each
shard's model tokens): token-level sums, extrema and second moments in float64, and one row of values
per sequence (a sample: every model token of it, its turns together, as a framework's loss mask
holds it). A framework reduces over micro-batches and ranks; the global batch is one step here, and
where a framework's reduction would depend on its batch layout (SkyRL's std over a padded batch) the
entry says what is computed instead. NumPy here (analysis/kernels.py computes a shard's
:class:`PeerPart` in its compiled loop); no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from mismatch_probe.analysis.terms import TokenTerms, token_terms
from mismatch_probe.config.spec import CorrectionThresholds

if TYPE_CHECKING:
    from mismatch_probe.analysis.terms import ShardTerms

# the clamp several frameworks apply to a log-ratio before exp (verl's and slime's SAFETY_BOUND,
# SkyRL's safe_exp_delta clip)
SAFETY_BOUND = 20.0

# the commits mismatch_probe/frameworks/<framework>.py read (each module's COMMIT)
VERL = "verl@b178a3c"
NEMO_RL = "NeMo-RL@7ea279a"
SLIME = "slime@624b824"
PRIME_RL = "prime-rl@559b447"
SKYRL = "SkyRL@a956457"
OPENRLHF = "OpenRLHF@3c3be62"
TRL = "TRL@f2cd577"


class PeerStats(NamedTuple):
    """What every peer metric is computed from: float64 token statistics and per-sequence values."""

    n: int  # model tokens
    tok: dict[str, float]  # token-level sums, extrema and second moments (see PeerAccumulator)
    seq: dict[str, np.ndarray]  # one value per sequence
    thresholds: CorrectionThresholds


@dataclass(frozen=True)
class PeerMetric:
    framework: str  # a name of mismatch_probe/frameworks FRAMEWORKS
    key: str  # as the framework logs it; "[...]" names a variant its configuration selects
    formula: str
    source: str  # file:line at the framework's commit
    compute: Callable[[PeerStats], float | None]
    probe: str | None = None  # the probe's metric of the same value, if any
    note: str = ""  # where this differs from the framework's own number, and why


def _mean(s: PeerStats, key: str) -> float | None:
    return s.tok[key] / s.n if s.n else None


def _std(s: PeerStats, key: str) -> float | None:
    """Unbiased sd (torch.std's) of a token quantity from its streamed sum of squared deviations."""
    if s.n < 2:
        return None
    return math.sqrt(s.tok[key + "_m2"] / (s.n - 1))


def _seq_mean(s: PeerStats, key: str) -> float | None:
    v = s.seq[key]
    return float(v.mean()) if len(v) else None


def _token_weighted(s: PeerStats, key: str) -> float | None:
    """A per-sequence value expanded to its tokens and averaged over every token (slime's per-token
    reduction of a sequence metric)."""
    n = s.seq["n_tokens"]
    return float((s.seq[key] * n).sum() / n.sum()) if n.sum() else None


def _seq_stat(fn: Callable[[np.ndarray], float], key: str) -> Callable[[PeerStats], float | None]:
    return lambda s: fn(s.seq[key]) if len(s.seq[key]) else None


def _share(key: str) -> Callable[[PeerStats], float | None]:
    return lambda s: _mean(s, key)


def _seq_share(key: str) -> Callable[[PeerStats], float | None]:
    return lambda s: float(s.seq[key].mean()) if len(s.seq[key]) else None


def _slime(
    name: str,
    formula: str,
    line: str,
    *,
    token_level: str | None = None,
    probe: str | None = None,
    probe_default: str | None = None,
) -> list[PeerMetric]:
    """A slime mis_* metric in its two reductions: the default (each sequence's token mean, then the
    mean over sequences: cp_utils.py:73-80 with ``calculate_per_token_loss`` off) and the per-token
    one (the mean over every token of the values expanded to tokens). ``probe``: the probe metric
    the per-token reduction equals; ``probe_default``: the one the default reduction equals."""
    seq_key = f"slime_{name}"
    default = PeerMetric(
        "slime",
        f"mis_{name}",
        f"mean over sequences of ({formula}) per sequence",
        f"{SLIME} examples/train_infer_mismatch_helper/mis.py:{line}; slime/backends/megatron_utils/cp_utils.py:73",
        lambda s: _seq_mean(s, seq_key),
        probe=probe_default,
    )
    per_token = PeerMetric(
        "slime",
        f"mis_{name}[per-token]",
        f"mean over tokens of ({formula}) {'per token' if token_level else 'of its sequence'} "
        "(--calculate-per-token-loss)",
        f"{SLIME} examples/train_infer_mismatch_helper/mis.py:{line}; slime/backends/megatron_utils/cp_utils.py:73",
        (lambda s: _token_sign(name) * s.tok[token_level] / s.n if s.n else None)
        if token_level
        else (lambda s: _token_weighted(s, seq_key)),
        probe=probe,
    )
    return [default, per_token]


def _token_sign(name: str) -> float:
    """slime's kl is logp_rollout − logp_train: −δ, from the sum of δ."""
    return -1.0 if name == "kl" else 1.0


def _nemo_kl(kind: str, side: str) -> Callable[[PeerStats], float | None]:
    """NeMo-RL's calculate_kl, logr = logprobs_reference − logprobs: δ for gen_kl_error (the reference
    is the trainer's), −δ for policy_kl_error; k1 = −logr, k2 = logr²/2, k3 = e^logr − logr − 1."""
    key = {"k1": "delta", "k2": "k2", "k3": "k3" if side == "gen" else "reverse_k3"}[kind]
    sign = -1.0 if (side, kind) == ("gen", "k1") else 1.0
    return lambda s: sign * s.tok[key] / s.n if s.n else None


PEER_METRICS: tuple[PeerMetric, ...] = (
    # ---- verl: rollout_corr/* (compute_offpolicy_metrics in verl/trainer/ppo/rollout_corr_helper.py) and
    # the debug metrics (calculate_debug_metrics in verl/utils/debug/metrics.py)
    PeerMetric(
        "verl",
        "rollout_corr/k3_kl",
        "mean over tokens of r − δ − 1",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:896",
        lambda s: _mean(s, "k3"),
        probe="k3_kl",
    ),
    PeerMetric(
        "verl",
        "rollout_corr/kl",
        "mean over tokens of −δ (logp_rollout − logp_train)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:889",
        lambda s: -_mean(s, "delta") if s.n else None,  # type: ignore[operator]
    ),
    PeerMetric(
        "verl",
        "rollout_corr/training_ppl",
        "mean over sequences of exp(−mean_t logp_train)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:879",
        lambda s: _seq_mean(s, "ppl_train"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/rollout_ppl",
        "mean over sequences of exp(−mean_t logp_infer)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:901",
        lambda s: _seq_mean(s, "ppl_infer"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/log_ppl_diff",
        "mean over sequences of (mean_t logp_infer − mean_t logp_train)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:910",
        lambda s: _seq_mean(s, "log_ppl_diff"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/log_ppl_abs_diff",
        "mean over sequences of |mean_t logp_infer − mean_t logp_train|",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:911",
        lambda s: _seq_mean(s, "log_ppl_abs_diff"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/log_ppl_diff_max",
        "max over sequences of (mean_t logp_infer − mean_t logp_train)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:912",
        _seq_stat(lambda v: float(v.max()), "log_ppl_diff"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/log_ppl_diff_min",
        "min over sequences of (mean_t logp_infer − mean_t logp_train)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:913",
        _seq_stat(lambda v: float(v.min()), "log_ppl_diff"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/training_log_ppl",
        "mean over sequences of −mean_t logp_train",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:882",
        lambda s: _seq_mean(s, "slime_training_log_ppl"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/rollout_log_ppl",
        "mean over sequences of −mean_t logp_infer",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:902",
        lambda s: _seq_mean(s, "slime_rollout_log_ppl"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/ppl_ratio",
        "mean over sequences of exp(mean_t logp_infer − mean_t logp_train)",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:921",
        lambda s: _seq_mean(s, "ppl_ratio"),
    ),
    PeerMetric(
        "verl",
        "rollout_corr/chi2_token",
        "mean over tokens of exp(clamp(δ, ±20))² − 1",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:931",
        lambda s: _mean(s, "rho2") - 1.0 if s.n else None,  # type: ignore[operator]
        probe="chi2_token",
        note="equal to the probe's chi2_token while no |δ| passes 20, where verl clamps and the probe does not",
    ),
    PeerMetric(
        "verl",
        "rollout_corr/chi2_seq",
        "mean over sequences of exp(2 · clamp(Σ_t δ, ±20)) − 1",
        f"{VERL} verl/trainer/ppo/rollout_corr_helper.py:938",
        lambda s: _seq_mean(s, "rho_sq_seq") - 1.0 if len(s.seq["rho_sq_seq"]) else None,  # type: ignore[operator]
    ),
    PeerMetric(
        "verl",
        "training/rollout_probs_diff_mean",
        "mean over tokens of |p_train − p_infer|",
        f"{VERL} verl/utils/debug/metrics.py:106",
        lambda s: _mean(s, "abs_dp"),
        probe="prob_diff_mean",
    ),
    PeerMetric(
        "verl",
        "training/rollout_probs_diff_max",
        "max over tokens of |p_train − p_infer|",
        f"{VERL} verl/utils/debug/metrics.py:105",
        lambda s: s.tok["abs_dp_max"] if s.n else None,
        probe="prob_diff_max",
    ),
    PeerMetric(
        "verl",
        "training/rollout_probs_diff_std",
        "unbiased sd over tokens of |p_train − p_infer|",
        f"{VERL} verl/utils/debug/metrics.py:107",
        lambda s: _std(s, "abs_dp"),
    ),
    # ---- NeMo-RL: ClippedPGLossFn (nemo_rl/algorithms/loss/loss_functions.py), KL types from
    # calculate_kl in nemo_rl/algorithms/utils.py (logr = logprobs_reference − logprobs)
    PeerMetric(
        "nemo-rl",
        "token_mult_prob_error",
        "mean over tokens of exp(|δ|)",
        f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:408",
        lambda s: _mean(s, "mult"),
        probe="mult_prob_error",
    ),
    *(
        PeerMetric(
            "nemo-rl",
            "gen_kl_error" if kind == "k3" else f"gen_kl_error[{kind}]",
            {"k1": "mean over tokens of −δ", "k2": "mean over tokens of δ²/2", "k3": "mean over tokens of r − δ − 1"}[
                kind
            ]
            + f" (reference_policy_kl_type {kind}{', its default' if kind == 'k3' else ''})",
            f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:416; nemo_rl/algorithms/utils.py:72",
            _nemo_kl(kind, "gen"),
            probe="k3_kl" if kind == "k3" else None,
        )
        for kind in ("k3", "k1", "k2")
    ),
    *(
        PeerMetric(
            "nemo-rl",
            "policy_kl_error" if kind == "k3" else f"policy_kl_error[{kind}]",
            {
                "k1": "mean over tokens of δ",
                "k2": "mean over tokens of δ²/2",
                "k3": "mean over tokens of exp(−δ) + δ − 1",
            }[kind]
            + f" (reference_policy_kl_type {kind}{', its default' if kind == 'k3' else ''})",
            f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:431; nemo_rl/algorithms/utils.py:72",
            _nemo_kl(kind, "policy"),
        )
        for kind in ("k3", "k1", "k2")
    ),
    PeerMetric(
        "nemo-rl",
        "js_divergence_error",
        "mean over tokens of ½[e^(a)−a−1] + ½[e^(b)−b−1], a = logp_train − m, b = logp_infer − m, "
        "m = log(½p_train + ½p_infer)",
        f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:462",
        lambda s: _mean(s, "js"),
    ),
    PeerMetric(
        "nemo-rl",
        "sampling_importance_ratio",
        "mean over tokens of r (an infinite r counts 0: nan_to_num); token-level IS, no truncation (the defaults)",
        f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:704",
        lambda s: _mean(s, "r_finite"),
    ),
    PeerMetric(
        "nemo-rl",
        "is_oob_ratio[tis]",
        "share of tokens with r > token_tis (truncated_importance_sampling_type tis)",
        f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:597",
        _share("oob_tis"),
        probe="token_tis_clipped_share",
    ),
    PeerMetric(
        "nemo-rl",
        "is_oob_ratio[icepop]",
        "share of tokens with r outside [token_mask_low, token_mask_high] (icepop)",
        f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:617",
        _share("oob_icepop"),
        probe="token_mask_share",
    ),
    PeerMetric(
        "nemo-rl",
        "is_oob_ratio[seq-mask-tis]",
        "share of sequences whose exp(mean_t δ) is outside [1 − geo_eps, 1 + geo_eps] (seq-mask-tis)",
        f"{NEMO_RL} nemo_rl/algorithms/loss/loss_functions.py:637",
        _seq_share("geo_oob"),
        probe="geo_rejected_share",
    ),
    # ---- slime: mis_* (add_ppl_metrics in examples/train_infer_mismatch_helper/mis.py) and the trainer's own
    *_slime("training_log_ppl", "−mean_t logp_train", "394"),
    *_slime("training_ppl", "exp(−mean_t logp_train)", "395"),
    *_slime("rollout_log_ppl", "−mean_t logp_infer", "401"),
    *_slime("rollout_ppl", "exp(−mean_t logp_infer)", "402"),
    *_slime("kl", "−δ", "408", token_level="delta", probe="k1_kl"),
    *_slime("k3_kl", "r − δ − 1", "415", token_level="k3", probe="k3_kl"),
    # weighted by its tokens, each sequence's mean difference sums to the token mean of −δ
    *_slime("log_ppl_diff", "mean_t logp_infer − mean_t logp_train", "423", probe="k1_kl"),
    *_slime("log_ppl_abs_diff", "|mean_t logp_infer − mean_t logp_train|", "424"),
    *_slime("ppl_ratio", "exp(mean_t logp_infer − mean_t logp_train)", "430"),
    *_slime("chi2_token", "mean_t exp(clamp(δ, ±20))² − 1", "442"),
    # a sequence's value, so the mean over sequences is the probe's chi2_seq (clamped alike); slime's
    # chi2_token clamps δ at ±20 where the probe's does not, so it has no counterpart that equals it
    *_slime("chi2_seq", "exp(2 · clamp(Σ_t δ, ±20)) − 1", "451", probe_default="chi2_seq"),
    PeerMetric(
        "slime",
        "train_rollout_logprob_abs_diff",
        "mean over sequences of mean_t |δ|",
        f"{SLIME} slime/backends/megatron_utils/loss.py:1140; slime/backends/megatron_utils/cp_utils.py:73",
        lambda s: _seq_mean(s, "slime_abs_delta"),
    ),
    PeerMetric(
        "slime",
        "train_rollout_logprob_abs_diff[per-token]",
        "mean over tokens of |δ| (--calculate-per-token-loss)",
        f"{SLIME} slime/backends/megatron_utils/loss.py:1140; slime/backends/megatron_utils/cp_utils.py:73",
        lambda s: _mean(s, "abs_delta"),
        probe="abs_delta_mean",
    ),
    # ---- prime-rl: mismatch_kl/all/* (trainer/rl/train.py gathers K3 per token, trainer/utils.py reduces)
    PeerMetric(
        "prime-rl",
        "mismatch_kl/all/mean",
        "mean over tokens of r − δ − 1",
        f"{PRIME_RL} src/prime_rl/trainer/rl/train.py:510; src/prime_rl/trainer/utils.py:271",
        lambda s: _mean(s, "k3"),
        probe="k3_kl",
    ),
    PeerMetric(
        "prime-rl",
        "mismatch_kl/all/std",
        "unbiased sd over tokens of r − δ − 1",
        f"{PRIME_RL} src/prime_rl/trainer/utils.py:273",
        lambda s: _std(s, "k3"),
    ),
    PeerMetric(
        "prime-rl",
        "mismatch_kl/all/max",
        "max over tokens of r − δ − 1",
        f"{PRIME_RL} src/prime_rl/trainer/utils.py:275",
        lambda s: s.tok["k3_max"] if s.n else None,
    ),
    PeerMetric(
        "prime-rl",
        "mismatch_kl/all/min",
        "min over tokens of r − δ − 1",
        f"{PRIME_RL} src/prime_rl/trainer/utils.py:274",
        lambda s: s.tok["k3_min"] if s.n else None,
    ),
    # ---- SkyRL: off_policy_correction_utils.py (the IS ratio) and trainer.py (the forward pass's diff)
    PeerMetric(
        "skyrl",
        "is_ratio_mean",
        "mean over tokens of exp(clamp(δ, ±20))",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:309",
        lambda s: _mean(s, "r_clamped"),
    ),
    PeerMetric(
        "skyrl",
        "is_ratio_max",
        "max over tokens of exp(clamp(δ, ±20))",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:311",
        lambda s: s.tok["r_clamped_max"] if s.n else None,
    ),
    PeerMetric(
        "skyrl",
        "is_ratio_std",
        "unbiased sd over tokens of exp(clamp(δ, ±20))",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:310",
        lambda s: _std(s, "r_clamped"),
        note="SkyRL takes it over its padded batch, masked positions as 0, which depends on its padding",
    ),
    PeerMetric(
        "skyrl",
        "tis_token_clip_high_ratio",
        "share of tokens with r > token_tis (tis_ratio_type token)",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:59",
        _share("oob_tis"),
        probe="token_tis_clipped_share",
    ),
    PeerMetric(
        "skyrl",
        "geo_sequence_mask_masked_ratio",
        "share of sequences whose exp(mean_t δ) is outside [1 − geo_eps, 1 + geo_eps] (sequence_mask_metric geometric)",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:232",
        _seq_share("geo_oob"),
        probe="geo_rejected_share",
    ),
    PeerMetric(
        "skyrl",
        "geo_sequence_mask_over_high_ratio",
        "share of sequences whose exp(mean_t δ) is above 1 + geo_eps (sequence_mask_metric geometric)",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:233",
        _seq_share("geo_over"),
    ),
    PeerMetric(
        "skyrl",
        "geo_sequence_mask_under_low_ratio",
        "share of sequences whose exp(mean_t δ) is below 1 − geo_eps (sequence_mask_metric geometric)",
        f"{SKYRL} skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:234",
        _seq_share("geo_under"),
    ),
    *(
        PeerMetric(
            "skyrl",
            f"policy/rollout_train_logprobs_abs_diff_{stat}",
            f"{word} over tokens of |δ|",
            f"{SKYRL} skyrl/train/trainer.py:1386",
            fn,
        )
        for stat, word, fn in (
            ("mean", "mean", lambda s: _mean(s, "abs_delta")),
            ("std", "unbiased sd", lambda s: _std(s, "abs_delta")),
            ("max", "max", lambda s: s.tok["abs_delta_max"] if s.n else None),
            ("min", "min", lambda s: s.tok["abs_delta_min"] if s.n else None),
        )
    ),
    # ---- OpenRLHF: the actor's vllm_kl (PolicyLoss in openrlhf/models/loss.py, logged by openrlhf/trainer/ray/ppo_actor.py)
    PeerMetric(
        "openrlhf",
        "vllm_kl",
        "mean over tokens of −δ (rollout_log_probs − old_log_probs)",
        f"{OPENRLHF} openrlhf/models/loss.py:218; openrlhf/trainer/ray/ppo_actor.py:317",
        lambda s: -_mean(s, "delta") if s.n else None,  # type: ignore[operator]
    ),
    # ---- TRL: GRPOTrainer's sampling/* (trl/trainer/grpo_trainer.py), under its default
    # vllm_importance_sampling_mode "sequence_mask" with clip_max 3.0 (grpo_config.py:924, :937)
    PeerMetric(
        "trl",
        "sampling/sampling_logp_difference/mean",
        "mean over tokens of |δ|",
        f"{TRL} trl/trainer/grpo_trainer.py:2785",
        lambda s: _mean(s, "abs_delta"),
    ),
    PeerMetric(
        "trl",
        "sampling/sampling_logp_difference/max",
        "max over tokens of |δ|",
        f"{TRL} trl/trainer/grpo_trainer.py:2788",
        lambda s: s.tok["abs_delta_max"] if s.n else None,
    ),
    *(
        PeerMetric(
            "trl",
            f"sampling/importance_sampling_ratio/{stat}",
            f"{word} over sequences of exp(Σ_t δ), set to 0 above seq_mis (sequence_mask, clip_max)",
            f"{TRL} trl/trainer/grpo_trainer.py:2590, :2614, :2805",
            _seq_stat(fn, "trl_seq_ratio"),
        )
        for stat, word, fn in (
            ("min", "min", lambda v: float(v.min())),
            ("mean", "mean", lambda v: float(v.mean())),
            ("max", "max", lambda v: float(v.max())),
        )
    ),
)


def frameworks() -> list[str]:
    """The frameworks with a dashboard, in registry order."""
    return list(dict.fromkeys(m.framework for m in PEER_METRICS))


def metrics_of(framework: str) -> list[PeerMetric]:
    return [m for m in PEER_METRICS if m.framework == framework]


# the token statistics PeerAccumulator keeps: sums, extrema, and for an sd the sum of squared deviations
# from the mean ("_m2", merged across shards: PeerAccumulator.merge)
TOKEN_SUMS = (
    "delta", "abs_delta", "k2", "k3", "reverse_k3", "mult", "rho2", "abs_dp",
    "js", "r_finite", "r_clamped", "oob_tis", "oob_icepop",
)  # fmt: skip
TOKEN_M2 = ("abs_delta_m2", "k3_m2", "abs_dp_m2", "r_clamped_m2")
TOKEN_MAX = ("abs_delta_max", "k3_max", "abs_dp_max", "r_clamped_max")
TOKEN_MIN = ("abs_delta_min", "k3_min")
LOG4 = math.log(4.0)


def token_values(terms: TokenTerms, lt: np.ndarray, li: np.ndarray, th: CorrectionThresholds) -> dict[str, np.ndarray]:
    """Every per-token quantity a peer metric averages, for one shard's model tokens (float64), from the
    token terms the metrics pass computed (analysis/terms.py: token_terms) and what they lack."""
    d, r = terms.delta, terms.ratio
    with np.errstate(over="ignore", invalid="ignore"):
        reverse_k3 = np.expm1(-d)
        reverse_k3 += d  # exp(−δ) + δ − 1: NeMo-RL's policy_kl_error under k3
        # NeMo-RL's JS term, ½[x − ln x − 1] + ½[y − ln y − 1] with x = 2p_t/(p_t+p_i), y = 2 − x,
        # is −½ ln(xy) = ½ (2 ln(p_t + p_i) − logp_t − logp_i − ln 4): one logaddexp, stable in the tails
        js = np.logaddexp(lt, li)
        js *= 2.0
        js -= lt
        js -= li
        js -= LOG4
        js *= 0.5
        rc = np.clip(r, math.exp(-SAFETY_BOUND), math.exp(SAFETY_BOUND))  # exp(clamp(δ, ±20))
    return {
        "delta": d,
        "abs_delta": terms.abs_delta,
        "k2": terms.k2,
        "k3": terms.k3,
        "reverse_k3": reverse_k3,
        "mult": terms.mult_error,
        "rho2": rc * rc,
        "abs_dp": terms.prob_diff,
        "js": js,
        "r_finite": np.where(np.isfinite(r), r, 0.0),
        "r_clamped": rc,
        "oob_tis": (r > th.token_tis).astype(np.float64),
        "oob_icepop": ((r < th.token_mask_low) | (r > th.token_mask_high)).astype(np.float64),
    }


# each sequence's sums sequence_values reads (a shard holds whole sequences)
SEQUENCE_SUMS = ("logp_train", "logp_infer", "delta", "rho2", "k3", "abs_delta")


def sequence_sums(
    lt: np.ndarray, li: np.ndarray, starts: np.ndarray, tv: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """:data:`SEQUENCE_SUMS` of each sequence of one shard (``starts``: each sequence's first token)."""
    columns = {"logp_train": np.asarray(lt, np.float64), "logp_infer": np.asarray(li, np.float64)} | tv
    return {k: np.add.reduceat(columns[k], starts) for k in SEQUENCE_SUMS}


def sequence_values(
    n_tokens: np.ndarray, sums: dict[str, np.ndarray], th: CorrectionThresholds
) -> dict[str, np.ndarray]:
    """Every per-sequence value a peer metric reduces, from each sequence's length and
    :data:`SEQUENCE_SUMS` (:func:`sequence_sums`, or the compiled pass's: analysis/kernels.py)."""
    n = np.asarray(n_tokens, np.float64)

    def mean(key: str) -> np.ndarray:
        return sums[key] / n

    mt, mi = mean("logp_train"), mean("logp_infer")
    sum_d = sums["delta"]
    with np.errstate(over="ignore"):
        geo = np.exp(sum_d / n)
        trl = np.exp(sum_d)
    log_ppl_diff = mi - mt
    chi2_token = mean("rho2") - 1.0
    chi2_seq = np.exp(2.0 * np.clip(sum_d, -SAFETY_BOUND, SAFETY_BOUND)) - 1.0
    out = {
        "n_tokens": n,
        "ppl_train": np.exp(-mt),
        "ppl_infer": np.exp(-mi),
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": np.abs(log_ppl_diff),
        "ppl_ratio": np.exp(log_ppl_diff),
        "rho_sq_seq": chi2_seq + 1.0,
        "geo_oob": ((geo < 1.0 - th.geo_eps) | (geo > 1.0 + th.geo_eps)).astype(np.float64),
        "geo_over": (geo > 1.0 + th.geo_eps).astype(np.float64),
        "geo_under": (geo < 1.0 - th.geo_eps).astype(np.float64),
        # sequence_mask: a ratio above clip_max is set to 0; frameworks/trl.py reads clip_max under
        # sequence_mask into the spec's seq_mis (a sequence mask), not token_tis
        "trl_seq_ratio": np.where(trl > th.seq_mis, 0.0, trl),
        "slime_training_log_ppl": -mt,
        "slime_training_ppl": np.exp(-mt),
        "slime_rollout_log_ppl": -mi,
        "slime_rollout_ppl": np.exp(-mi),
        "slime_kl": -mean("delta"),
        "slime_k3_kl": mean("k3"),
        "slime_log_ppl_diff": log_ppl_diff,
        "slime_log_ppl_abs_diff": np.abs(log_ppl_diff),
        "slime_ppl_ratio": np.exp(log_ppl_diff),
        "slime_chi2_token": chi2_token,
        "slime_chi2_seq": chi2_seq,
        "slime_abs_delta": mean("abs_delta"),
    }
    return out


class PeerPart(NamedTuple):
    """One shard's share of :class:`PeerAccumulator`'s statistics: its token count, the sums, the
    sums of squared deviations about the shard's own mean, the extrema (in the order of
    TOKEN_SUMS, TOKEN_M2, TOKEN_MAX, TOKEN_MIN), its sequences' values, and the thresholds they
    were computed with."""

    n: int
    sums: np.ndarray
    m2: np.ndarray
    maxima: np.ndarray
    minima: np.ndarray
    seq: dict[str, np.ndarray]
    thresholds: CorrectionThresholds


def peer_part(
    lt: np.ndarray, li: np.ndarray, starts: np.ndarray, terms: TokenTerms | None, th: CorrectionThresholds
) -> PeerPart:
    """A non-empty shard's :class:`PeerPart`, in NumPy (the compiled pass computes it in its own loop)."""
    lt, li = np.asarray(lt, np.float64), np.asarray(li, np.float64)
    tv = token_values(terms if terms is not None else token_terms(lt, li), lt, li, th)
    m2 = []
    for key in TOKEN_M2:
        x = tv[key.removesuffix("_m2")]
        with np.errstate(invalid="ignore"):  # an infinite term (p_train = 0) makes the sd NaN, as torch's
            dev = x - x.mean()
            m2.append(float(np.dot(dev, dev)))
    n = np.diff(np.append(starts, len(lt)))
    return PeerPart(
        len(lt),
        np.array([tv[k].sum() for k in TOKEN_SUMS]),
        np.array(m2),
        np.array([tv[k.removesuffix("_max")].max() for k in TOKEN_MAX]),
        np.array([tv[k.removesuffix("_min")].min() for k in TOKEN_MIN]),
        sequence_values(n, sequence_sums(lt, li, starts, tv), th),
        th,
    )


@dataclass
class PeerAccumulator:
    """The peer metrics' statistics, streamed: :meth:`add` each shard's model tokens, :meth:`result` at
    the end. Token statistics are float64 sums and extrema; per-sequence values are kept (a few floats
    a sequence)."""

    thresholds: CorrectionThresholds = field(default_factory=CorrectionThresholds)
    n: int = 0
    tok: dict[str, float] = field(default_factory=dict)
    seq_parts: list[dict[str, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tok = (
            dict.fromkeys(TOKEN_SUMS + TOKEN_M2, 0.0)
            | dict.fromkeys(TOKEN_MAX, -math.inf)
            | dict.fromkeys(TOKEN_MIN, math.inf)
        )

    def add(self, lt: np.ndarray, li: np.ndarray, starts: np.ndarray, terms: TokenTerms | None = None) -> None:
        """One shard's model tokens (whole sequences; ``starts``: each one's first token), with their
        token terms when the caller has them already."""
        if len(lt):
            self.merge(peer_part(lt, li, starts, terms, self.thresholds))

    def add_shard(self, lt: np.ndarray, li: np.ndarray, starts: np.ndarray, shard: ShardTerms) -> None:
        """One shard as :meth:`.metrics.MetricsAccumulator.add` reduced it: its compiled pass's part when it
        computed one with these thresholds, else from its token terms."""
        part = shard.peers
        if part is None or part.thresholds != self.thresholds:
            part = peer_part(lt, li, starts, shard.terms, self.thresholds)
        self.merge(part)

    def merge(self, part: PeerPart) -> None:
        """Fold in one shard's part: sums add, extrema compare, and the squared deviations merge
        (Chan et al.) because the sum of squares less n·mean² cancels when the mean dwarfs the sd (an
        fp32 run's importance ratio: 1 ± 1e-6)."""
        n_before, n_shard = self.n, part.n
        self.n += n_shard
        for j, key in enumerate(TOKEN_M2):  # before the sums grow: the merge needs the mean so far
            base = key.removesuffix("_m2")
            mean_shard = float(part.sums[TOKEN_SUMS.index(base)]) / n_shard
            gap = mean_shard - (self.tok[base] / n_before if n_before else 0.0)
            self.tok[key] += float(part.m2[j]) + gap * gap * n_before * n_shard / self.n
        for key, value in zip(TOKEN_SUMS, part.sums):
            self.tok[key] += float(value)
        for key, value in zip(TOKEN_MAX, part.maxima):
            self.tok[key] = max(self.tok[key], float(value))
        for key, value in zip(TOKEN_MIN, part.minima):
            self.tok[key] = min(self.tok[key], float(value))
        self.seq_parts.append(part.seq)

    def stats(self) -> PeerStats:
        keys = sequence_values(np.ones(1), dict.fromkeys(SEQUENCE_SUMS, np.zeros(1)), self.thresholds)
        seq = {k: np.concatenate([p[k] for p in self.seq_parts]) if self.seq_parts else np.zeros(0) for k in keys}
        return PeerStats(self.n, dict(self.tok), seq, self.thresholds)

    def result(self) -> dict[str, dict[str, float | None]]:
        """run.json's ``dashboard``: ``{framework: {key: value}}`` for every framework of the registry."""
        return dashboard(self.stats())


def dashboard(stats: PeerStats) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for m in PEER_METRICS:
        with np.errstate(over="ignore", invalid="ignore"):
            value = m.compute(stats)
        out.setdefault(m.framework, {})[m.key] = None if value is None else float(value)
    return out
