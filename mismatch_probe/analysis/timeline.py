"""One training step's row of a timeline: every metric of the step, its sampling noise, per turn group.

A timeline (``mismatch-probe timeline``, ``mismatch_probe.Monitor``) reduces each step of an RL run to
the metrics a run report gives (the same :class:`~.metrics.MetricsAccumulator`, so a step's K3 is
the K3 ``analyze`` would report for that step), one row per turn group (``all``, ``first``,
``later``), plus the sequence-level bootstrap interval of the metrics a drift test reads (the
per-step sampling noise: which sequences that step happened to sample). Pure: arrays in, rows out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from mismatch_probe.analysis.intervals import bootstrap_intervals
from mismatch_probe.analysis.metrics import (
    CORRECTION_KEYS,
    GROUP_TURNS,
    KEPT_K3,
    METRIC_KEYS,
    CorrectionThresholds,
    MetricsAccumulator,
)
from mismatch_probe.analysis.peer_metrics import PEER_METRICS, PeerAccumulator
from mismatch_probe.analysis.routing_agreement import RoutingAccumulator, compare_routing
from mismatch_probe.analysis.terms import SequenceTerms, segment_starts

STEP_GROUPS = ("all", *GROUP_TURNS)  # all model tokens; the first assistant turn; the later ones
# the metrics whose per-step bootstrap interval is kept: the ones the drift test and the page read
INTERVAL_KEYS = ("k3_kl", "k1_kl", "prob_diff_max", "prob_diff_mean", "mult_prob_error", "seq_max_mismatch_mean")
CORRECTION_COLUMNS = tuple(k for key in CORRECTION_KEYS for k in (key, KEPT_K3[key]))
ROUTING_COLUMNS = ("routing_flip_share", "routing_set_agreement_mean")
# each RL framework's own metrics of the step (group all), named as a gate names them in run.json
DASHBOARD_COLUMNS = tuple(f"dashboard.{m.framework}.{m.key}" for m in PEER_METRICS)
COUNT_COLUMNS = ("n_samples", "n_model_tokens", "n_sequences", "n_zero_prob_train", "seq_max_mismatch_gt_0_5_count")
# every value column of steps.parquet, in order; a value a step cannot have (routing of a dense
# model, the later turns of a single-turn run) is null
VALUE_COLUMNS = tuple(
    dict.fromkeys(
        (
            *COUNT_COLUMNS,
            *METRIC_KEYS,
            *CORRECTION_COLUMNS,
            *ROUTING_COLUMNS,
            *(f"{k}_{end}" for k in INTERVAL_KEYS for end in ("low", "high")),
            *DASHBOARD_COLUMNS,
        )
    )
)
STEP_SCHEMA = pa.schema(
    [("step", pa.int64()), ("group", pa.string())]
    + [(c, pa.int64() if c in COUNT_COLUMNS else pa.float64()) for c in VALUE_COLUMNS]
)
# the metrics tested for drift and the scale each is tested on: a log scale for a positive metric
# whose growth is multiplicative (K3 "3x its baseline"), linear for a share or an error near 1.
# Higher is worse for each.
DRIFT_METRICS = {
    "k3_kl": "log",
    "prob_diff_max": "log",
    "prob_diff_mean": "log",
    "mult_prob_error": "linear",
    "seq_max_mismatch_mean": "log",
    "chi2_token": "log",
    "token_tis_clipped_share": "linear",
    "geo_rejected_share": "linear",
    "routing_flip_share": "linear",
}
N_BOOT = 400  # replicates of a step's interval: its ends move by a few percent between seeds


@dataclass
class StepTokens:
    """The model tokens of one step, in sample order (a sample's tokens together, its turns in order).

    ``logp_train`` is the trainer's (or the reference's) log-prob, ``logp_infer`` the engine's;
    ``experts_*``: int [tokens, MoE layers, top-k], both or neither. ``n_samples`` counts every
    sample of the step, also one without a model token."""

    sample_id: np.ndarray
    turn: np.ndarray
    position: np.ndarray
    logp_infer: np.ndarray
    logp_train: np.ndarray
    n_samples: int
    experts_infer: np.ndarray | None = None
    experts_train: np.ndarray | None = None

    @classmethod
    def concatenate(cls, parts: list[StepTokens]) -> StepTokens:
        routed = [p for p in parts if p.experts_infer is not None and p.experts_train is not None]
        return cls(
            sample_id=np.concatenate([p.sample_id for p in parts]).astype(np.int64),
            turn=np.concatenate([p.turn for p in parts]).astype(np.int16),
            position=np.concatenate([p.position for p in parts]).astype(np.int64),
            logp_infer=np.concatenate([p.logp_infer for p in parts]).astype(np.float64),
            logp_train=np.concatenate([p.logp_train for p in parts]).astype(np.float64),
            n_samples=sum(p.n_samples for p in parts),
            experts_infer=np.concatenate([p.experts_infer for p in routed]) if len(routed) == len(parts) else None,  # type: ignore[misc]
            experts_train=np.concatenate([p.experts_train for p in routed]) if len(routed) == len(parts) else None,  # type: ignore[misc]
        )


def step_rows(
    step: int,
    tokens: StepTokens,
    thresholds: CorrectionThresholds | None = None,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = 0.95,
) -> list[dict]:
    """steps.parquet's rows of one step: one per group of :data:`STEP_GROUPS` that has tokens
    (``all`` always), every column of :data:`STEP_SCHEMA`. The bootstrap is seeded by ``seed`` and
    the step, so a step's row is the same however often and in whichever process it is computed."""
    acc = MetricsAccumulator(thresholds or CorrectionThresholds(), bucket_quantiles=False)
    starts = segment_starts(tokens.sample_id)
    # no positions: a step's row reads no breakdown, so the position table is not built
    done = acc.add(tokens.logp_train, tokens.logp_infer, starts, None, tokens.turn)
    routing: dict[str, RoutingAccumulator] = {}
    if done is not None and tokens.experts_infer is not None and tokens.experts_train is not None:
        _, n_layers, top_k = np.shape(tokens.experts_infer)
        cmp = compare_routing(tokens.experts_infer, tokens.experts_train, n_layers, top_k)
        for name in STEP_GROUPS:
            keep = None if name == "all" else GROUP_TURNS[name](tokens.turn)
            routing[name] = RoutingAccumulator(n_layers, top_k)
            routing[name].add(cmp, terms=done.terms, keep=keep)
    peers = PeerAccumulator(thresholds or CorrectionThresholds())
    if done is not None:
        peers.add_shard(tokens.logp_train, tokens.logp_infer, starts, done)
    dashboard = {f"dashboard.{fw}.{key}": v for fw, values in peers.result().items() for key, v in values.items()}
    rows = []
    for group in STEP_GROUPS:
        metrics = acc.metrics(group)
        if group != "all" and not metrics["n_model_tokens"]:
            continue
        corrections = acc.corrections(group)
        row: dict = dict.fromkeys(VALUE_COLUMNS)
        row.update({k: v for k, v in metrics.items() if k in row})
        row.update({k: corrections.get(k) for k in CORRECTION_COLUMNS})
        row["n_samples"] = tokens.n_samples if group == "all" else _n_samples(tokens, group)
        if group == "all":
            row.update(dashboard)
        if group in routing and (r := routing[group].result())["n_tokens"]:
            row["routing_flip_share"] = r["tokens_with_flip_share"]
            row["routing_set_agreement_mean"] = r["set_agreement_mean"]
        if metrics["n_sequences"]:
            seq = acc.sequences(group)
            columns = {name: np.asarray(getattr(seq, name)) for name in SequenceTerms._fields}
            intervals = bootstrap_intervals(
                columns, list(INTERVAL_KEYS), n_boot=n_boot, level=level, seed=_seed(seed, step, group)
            )
            for key, interval in intervals.items():
                if interval is not None:
                    row[f"{key}_low"], row[f"{key}_high"] = interval.low, interval.high
        rows.append({"step": int(step), "group": group} | {k: _plain(row[k], k) for k in VALUE_COLUMNS})
    return rows


def rows_table(rows: list[dict]) -> pa.Table:
    """Rows of :func:`step_rows` (of one step or many) as an Arrow table of :data:`STEP_SCHEMA`."""
    return pa.Table.from_pylist(rows, schema=STEP_SCHEMA)


def _n_samples(tokens: StepTokens, group: str) -> int:
    """Samples with a token in the turn group: the distinct ids of its runs (a sample's tokens are
    together, so a few thousand runs, not a sort of every token)."""
    ids = tokens.sample_id[GROUP_TURNS[group](tokens.turn)]
    return len(np.unique(ids[segment_starts(ids)]))


def _seed(seed: int, step: int, group: str) -> int:
    return (seed * 1_000_003 + step * 3 + STEP_GROUPS.index(group)) % (2**32)


def _plain(value, key: str):
    """A JSON/Arrow-ready number: NumPy scalars as Python ones; counts as ints."""
    if value is None:
        return None
    if key in COUNT_COLUMNS:
        return int(value)
    return float(value)
