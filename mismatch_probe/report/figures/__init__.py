"""Every figure of the reports, drawn with matplotlib: a run's seven (:mod:`.run`), the comparison
page's overlays (:mod:`.compare`), a sweep's forest and cost plots (:mod:`.sweep`) and a timeline's
metrics by step (:mod:`.timeline`), each written as inert, reproducible SVG (:mod:`.drawing`).

Each list below names a page's figures once (id, title, caption, how it is drawn); the page's view
(:mod:`mismatch_probe.report.run_view`, ...) shows the same list. Rendering only: every number drawn was
computed by the analysis. matplotlib is imported when the first figure is drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.analysis.metric_docs import METRIC_DOC, PUBLISHED_K3, fmt_range
from mismatch_probe.errors import ConfigError
from mismatch_probe.record import RunRecord
from mismatch_probe.report.data import Columns, RunData
from mismatch_probe.report.figures import compare, run, sweep, timeline
from mismatch_probe.report.figures.drawing import RUN_COLORS, finish, style, to_svg
from mismatch_probe.report.view import FigureInfo
from mismatch_probe.sweep_record import SweepRecord
from mismatch_probe.timeline_record import TimelineRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURES_DIR = "figures"  # in a run directory: figures/<id>.svg, which report.md shows


@dataclass(frozen=True)
class DrawnFigure:
    info: FigureInfo
    svg: bytes


def _figure(fid: str, title: str, caption: str, wide: bool = False) -> FigureInfo:
    """A figure written as ``figures/<id>.svg`` beside its page's Markdown (a run's, a timeline's)."""
    return FigureInfo(fid, title, caption, wide, f"{FIGURES_DIR}/{fid}.svg")


RunDraw = Callable[[RunRecord, dict], "Figure"]
RUN_FIGURES: tuple[tuple[FigureInfo, RunDraw], ...] = (
    (
        _figure(
            "prob_density",
            "Token probabilities: reference vs engine",
            "Each cell counts sampled tokens by their probability under the engine (x) and the reference (y). "
            "Agreement is the diagonal; mass off it is mismatch.",
            wide=True,
        ),
        run.prob_density,
    ),
    (
        _figure(
            "log_ppl_by_turn",
            "Log-ppl per sample-turn, first vs later turns",
            "One point per sample-turn. Later turns follow tool output, which is out of distribution for the model; "
            "published runs see them drift off the diagonal first.",
        ),
        run.log_ppl_by_turn,
    ),
    (
        _figure(
            "abs_delta_by_p_infer",
            "|delta| by engine probability",
            "Quantile bands of |logp_train − logp_infer| per p_infer bucket. Mismatch concentrates on "
            "low-probability tokens, which are also the ones with the largest gradients.",
        ),
        run.abs_delta_by_p_infer,
    ),
    (
        _figure(
            "seq_max_mismatch_hist",
            "Per-sequence max mismatch",
            "The largest token probability gap in each sequence, on [0, 1] and on a log axis. The parallelism "
            "study's headline is the share right of 0.5.",
            wide=True,
        ),
        run.seq_max_mismatch_hist,
    ),
    (
        _figure(
            "max_mismatch_vs_length",
            "Max mismatch vs response length",
            "Longer responses draw more tokens, so their worst token is worse even when the mean is flat.",
        ),
        run.max_mismatch_vs_length,
    ),
    (
        _figure(
            "mismatch_by_position",
            "Mismatch vs token position",
            "Mean and max gap by position in the full sequence (prompt included in the position).",
        ),
        run.mismatch_by_position,
    ),
    (
        _figure(
            "importance_ratio",
            "Importance ratios",
            "Token and sequence log importance weights log(π/μ). Dashed lines: the thresholds of the correction "
            "what-ifs below.",
            wide=True,
        ),
        run.importance_ratio,
    ),
    (
        _figure(
            "precision_rounds",
            "K3's interval, round by round",
            "An adaptive run (--precision): K3 and its 95% sequence-bootstrap interval after each round of sampling, "
            "against the samples so far; green: the band the target asks for around the last K3.",
        ),
        run.precision_rounds,
    ),
)
RUN_FIGURE_IDS = tuple(info.id for info, _ in RUN_FIGURES)
# the figures only some runs have, and which: the others are drawn for every run
RUN_FIGURE_WHEN: dict[str, Callable[[RunRecord], bool]] = {
    # a run that re-scores another's rollouts has that run's rounds, but not its K3
    "precision_rounds": lambda record: bool((record.precision or {}).get("rounds")) and not record.rollouts_from,
}


def run_figure_list(record: RunRecord) -> list[tuple[FigureInfo, RunDraw]]:
    """The figures ``record``'s report has, in report order."""
    return [(info, draw) for info, draw in RUN_FIGURES if RUN_FIGURE_WHEN.get(info.id, lambda _: True)(record)]


CompareDraw = Callable[[Sequence[RunData]], "Figure"]
COMPARISON_FIGURES: tuple[tuple[FigureInfo, CompareDraw], ...] = (
    (
        FigureInfo(
            "overlay_abs_delta_by_p_infer",
            "|delta| by engine probability",
            "p99 (solid) and mean (dotted) of |delta| per p_infer bucket.",
        ),
        compare.overlay_abs_delta_by_p_infer,
    ),
    (
        FigureInfo(
            "overlay_seq_max_mismatch",
            "Per-sequence max mismatch",
            "Share of sequences per (logarithmic) bin of their largest token probability gap; dashed: 0.5.",
        ),
        compare.overlay_seq_max_mismatch,
    ),
    (
        FigureInfo("overlay_log_ratio", "Importance ratios", "Token and sequence log-ratio distributions.", wide=True),
        compare.overlay_log_ratio,
    ),
    (
        FigureInfo(
            "overlay_position", "Mismatch vs token position", "Mean (solid) and max (dotted) |Δp| by position bucket."
        ),
        compare.overlay_position,
    ),
)

SweepDraw = Callable[[SweepRecord], "Figure"]


def sweep_figure_list() -> list[tuple[FigureInfo, SweepDraw]]:
    """A sweep page's figures: the points' effects on the headline metrics, the K3 the corrections
    leave, then cost against K3."""
    from mismatch_probe.analysis.sweep import HEADLINE_METRICS  # (its bootstrap code is not needed to draw)

    labels = {metric: METRIC_DOC[metric].label for metric in HEADLINE_METRICS}
    effects = FigureInfo(
        "effects",
        "Each point against the baseline",
        "Each point's x-fold change of " + ", ".join(labels.values()) + " against the baseline with its interval, "
        "a panel per metric; the band is the spread of the baseline's repeats, grey points are within noise.",
        wide=True,
    )
    rescue = FigureInfo(
        "rescue",
        "What each correction leaves",
        "Each point's K3 over every token (black) and the K3 of what each correction keeps (a marker "
        "each; one that drops nothing sits under the black dot); the band is the baseline repeats' K3. "
        "The shares each correction drops are in the corrections table.",
        wide=True,
    )
    cost = FigureInfo(
        "cost",
        "Cost vs K3",
        "Each point's throughput cost against its K3 KL, coloured by its gate status; dashed: the gate's K3 bound.",
    )
    return [
        (effects, lambda record: sweep.forest_plot(record, labels)),
        (rescue, sweep.rescue_plot),
        (cost, sweep.cost_plot),
    ]


TimelineDraw = Callable[[TimelineRecord, Columns], "Figure"]


def _has(columns: Columns, group: str, key: str) -> bool:
    values = columns[group].get(key)
    return values is not None and bool(np.isfinite(values).any())


MARKS = (
    "The grey band is the baseline window and the dashed grey line the baseline median; a solid line marks a "
    "change point (its interval shaded) and a dashed one of its colour the median from it to the alarm."
)


def timeline_figure_list(columns: Columns) -> list[tuple[FigureInfo, TimelineDraw]]:
    """The page's figures: K3, |Δp|, the multiplicative error, the sequence max mismatch, the
    importance-ratio tails and the corrections' shares, always; first vs later turns when the run
    has later turns; MoE routing when it was compared."""
    published = "; ".join(f"{f.precision} K3 {fmt_range(f.low, f.high)} ({f.source})" for f in PUBLISHED_K3)
    figures: list[tuple[FigureInfo, TimelineDraw]] = [
        (
            _figure(
                "k3_kl",
                "K3 KL by step",
                "Each step's K3 with its sequence-bootstrap interval (blue band), on a log axis. " + MARKS + " "
                f"Shaded in colour where they fall in view: the K3 published for quantized rollouts ({published}).",
                wide=True,
            ),
            timeline.k3_figure,
        ),
        (
            _figure(
                "prob_diff",
                "Token probability gap by step",
                "The largest |p_train − p_infer| of the step (red) and its mean over tokens (blue), with their "
                "intervals, on a log axis. " + MARKS,
            ),
            timeline.prob_diff_figure,
        ),
        (
            _figure(
                "mult_prob_error",
                "Multiplicative error by step",
                "mean exp(|δ|) of the step with its interval (NeMo-RL's token_mult_prob_error; 1 is perfect). " + MARKS,
            ),
            lambda record, columns: timeline.single_figure(record, columns, "mult_prob_error", log=False),
        ),
        (
            _figure(
                "seq_max_mismatch_mean",
                "Sequence max mismatch by step",
                "Per sequence the largest |Δp|, averaged over the step's sequences, with its interval. " + MARKS,
            ),
            lambda record, columns: timeline.single_figure(record, columns, "seq_max_mismatch_mean", log=True),
        ),
        (
            _figure(
                "ratio_tails",
                "Importance-ratio tails by step",
                "χ² of the token importance ratios as verl computes it (mean(ratio²) − 1: near 0 it can dip below "
                "0), their normalized effective sample size (1 is perfect), and the 99th percentile of |δ| (log "
                "axis). " + MARKS,
                wide=True,
            ),
            timeline.ratio_tails_figure,
        ),
        (
            _figure(
                "corrections",
                "What the corrections clip or drop, by step",
                "The share of tokens (token TIS, token mask) or sequences (sequence TIS, geometric rejection) each "
                "correction clips or drops at the timeline's thresholds. " + MARKS,
            ),
            timeline.corrections_figure,
        ),
    ]
    if _has(columns, "later", "k3_kl"):
        figures.append(
            (
                _figure(
                    "turns",
                    "K3 KL by step, first vs later turns",
                    "K3 of the first assistant turn and of the later turns (after tool output), with their intervals. "
                    "Later turns follow text the model did not write; published runs see them drift first.",
                ),
                timeline.turns_figure,
            )
        )
    if _has(columns, "all", "routing_flip_share"):
        figures.append(
            (
                _figure(
                    "routing_flip_share",
                    "MoE routing flips by step",
                    "The share of tokens for which some MoE layer picked another set of experts in the engine than "
                    "in the trainer. " + MARKS,
                ),
                lambda record, columns: timeline.single_figure(record, columns, "routing_flip_share", log=False),
            )
        )
    return figures


def check_figure_id(figure_id: str) -> None:
    if figure_id not in RUN_FIGURE_IDS:
        raise ConfigError(f"a run has no figure {figure_id!r}", hint=f"choose one of {', '.join(RUN_FIGURE_IDS)}")


def run_figure(record: RunRecord, dist: dict, figure_id: str) -> Figure:
    """One of a run's figures as a matplotlib ``Figure`` (for a notebook, or to save elsewhere)."""
    check_figure_id(figure_id)
    draw = {info.id: draw for info, draw in run_figure_list(record)}.get(figure_id)
    if draw is None:
        raise ConfigError(
            f"this run has no figure {figure_id!r} (only an adaptive run, sampled with --precision, has it)",
            hint=f"choose one of {', '.join(info.id for info, _ in run_figure_list(record))}",
        )
    with style():
        return finish(draw(record, dist))


def run_figures(record: RunRecord, dist: dict) -> list[DrawnFigure]:
    """Every figure of a one-run report, in report order, as SVG."""
    with style():
        return [DrawnFigure(info, to_svg(finish(draw(record, dist)))) for info, draw in run_figure_list(record)]


def comparison_figures(runs: Sequence[RunData]) -> list[DrawnFigure]:
    """The comparison page's overlays, as SVG: each run labelled and coloured (:func:`mismatch_probe.report.comparison_view.label_runs`)."""
    with style():
        return [DrawnFigure(info, to_svg(finish(draw(runs)))) for info, draw in COMPARISON_FIGURES]


def sweep_figures(record: SweepRecord) -> list[DrawnFigure]:
    """A sweep page's figures, as SVG."""
    with style():
        return [DrawnFigure(info, to_svg(finish(draw(record)))) for info, draw in sweep_figure_list()]


def timeline_figures(record: TimelineRecord, columns: Columns) -> list[DrawnFigure]:
    """A timeline page's figures, as SVG."""
    with style():
        return [
            DrawnFigure(info, to_svg(finish(draw(record, columns)))) for info, draw in timeline_figure_list(columns)
        ]


__all__ = [
    "COMPARISON_FIGURES",
    "FIGURES_DIR",
    "RUN_COLORS",
    "RUN_FIGURES",
    "RUN_FIGURE_IDS",
    "RUN_FIGURE_WHEN",
    "DrawnFigure",
    "FigureInfo",
    "check_figure_id",
    "comparison_figures",
    "run_figure",
    "run_figure_list",
    "run_figures",
    "sweep_figure_list",
    "sweep_figures",
    "timeline_figure_list",
    "timeline_figures",
]
