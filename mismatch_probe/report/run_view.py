"""A run's view: what ``report.html``, ``report.md`` and the terminal's summary of one run say,
built once from its record and distributions in the vocabulary of :mod:`.view`, so the three
cannot disagree. :func:`run_view` builds it; the weight-sync section is :mod:`.sync_view`'s.
Nothing here computes a number: every value comes from the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mismatch_probe.analysis.metric_docs import (
    CORRECTION_DOCS,
    KEPT_K3_MEANING,
    METRIC_DOCS,
    NEMO_RL_MULT_ERROR_THRESHOLD,
    k3_context,
    prob_diff_context,
)
from mismatch_probe.analysis.metrics import KEPT_K3
from mismatch_probe.analysis.next_steps import NEXT_SWEEP, SUGGESTED_GATE, next_steps
from mismatch_probe.analysis.peer_metrics import frameworks as peer_frameworks
from mismatch_probe.analysis.peer_metrics import metrics_of as peer_metrics_of
from mismatch_probe.analysis.precision import MAX_GROWTH, ROUND_MARGIN, outcome_line, percent
from mismatch_probe.config.sweep import sweep_of
from mismatch_probe.numbers import fmt, pct, ratio, seconds, short, tick
from mismatch_probe.record import RunRecord
from mismatch_probe.report import labels
from mismatch_probe.report.figures import run_figure_list
from mismatch_probe.report.sync_view import SyncView, sync_view
from mismatch_probe.report.view import Card, Column, FigureInfo, Pairs, Row, Span, Table, View, pairs
from mismatch_probe.version import __version__


@dataclass
class RunView(View):
    kind: Literal["run"]
    title: str
    name: str
    subtitle: str
    status: str
    headline: list[Card]
    notes: list[str]
    setup: Pairs
    stack: list[Table]  # the framework config the spec mirrors: its risks, what was not mirrored
    precision: Table | None  # an adaptive run's rounds (--precision)
    precision_outcome: str  # its outcome in one line (met, or not and why); "" for a run of a fixed size
    next_steps: Table  # what to do next, from the run's findings (analysis/next_steps.py)
    dashboard: Table | None  # the framework's own metrics ("Your dashboard"), when the run names one
    metrics: Table
    corrections: Table
    breakdowns: list[Table]
    routing: list[Table]  # empty when the model has no MoE routing
    routing_lead: str
    figures: list[FigureInfo]
    worst: Table  # one row per worst sequence; its tokens in worst_tokens
    worst_tokens: list[list[Span]]
    worst_has_text: bool
    run: Pairs
    timings: Table
    sync: SyncView | None = None  # a run that synced its engine's weights ([sync])
    version: str = __version__


def metrics_table(record: RunRecord) -> Table:
    """Every documented metric (``METRIC_DOCS``) in the columns of :func:`labels.metric_columns`."""
    columns = labels.metric_columns(record)
    rows = [
        Row(
            [doc.label]
            + ["-" if labels.not_measured(name, doc.key) else fmt(m.get(doc.key)) for name, m in columns]
            + [doc.meaning, doc.reference],
            key=doc.key,
        )
        for doc in METRIC_DOCS
    ]
    return Table(
        "metrics",
        "Metrics",
        [Column("metric", "text"), *(Column(name) for name, _ in columns), Column("meaning", "long")]
        + [Column("read it against", "long")],
        rows,
        lead=(
            "delta = logp_train − logp_infer over model tokens only; token-level means unless the name says "
            "sequence. The decode-vs-prefill column puts the engine's own full-sequence prefill log-prob in the "
            "reference's place: mismatch inside the engine, before any trainer is involved."
        ),
    )


def corrections_table(record: RunRecord) -> Table:
    """What each published correction would clip or drop (``CORRECTION_DOCS``), for all tokens and,
    in a run with later turns, per turn group."""
    corr, by_turn = record.corrections or {}, record.corrections_by_turn or {}
    thresholds = corr.get("thresholds") or {}
    groups = [(labels.main_column(record), corr)]
    if labels.has_later_turns(record):
        groups += [(labels.FIRST_TURN, by_turn.get("first") or {}), (labels.LATER_TURNS, by_turn.get("later") or {})]
    # a run analysed before the kept K3 was recorded shows the shares alone, as it did then
    kept = any(k in corr for k in KEPT_K3.values())

    def cells(values: dict, key: str) -> list[str]:
        return [pct(values.get(key)), fmt(values.get(KEPT_K3[key]))] if kept else [pct(values.get(key))]

    rows = [
        Row(
            [
                doc.label,
                doc.meaning,
                ", ".join(f"{a.replace('_', ' ')} {tick(b)}" for a, b in (thresholds.get(key) or {}).items()),
            ]
            + [cell for _, values in groups for cell in cells(values, key)],
            key=key,
        )
        for key, doc in CORRECTION_DOCS.items()
    ]
    lead = "How much of this data each published correction would clip or drop at these thresholds, before you train with it"
    if kept:
        lead += (
            ", and the K3 of the tokens it keeps as they came (unclipped, unmasked, in sequences it keeps): "
            + KEPT_K3_MEANING
        )
    return Table(
        "corrections",
        "Correction what-ifs",
        [Column("correction", "text"), Column("what it does", "long"), Column("threshold", "text")]
        + [
            c
            for name, _ in groups
            for c in ([Column(name), Column(f"{name}: K3 of what it keeps")] if kept else [Column(name)])
        ],
        rows,
        lead=lead + ".",
    )


def _bucket(lo, hi, closed: bool = False) -> str:
    """A bucket's range, "[lo, hi)" ("]" when it holds its upper edge; "inf" when it has none)."""

    def edge(v) -> str:
        return fmt(v) if isinstance(v, int) else tick(v)

    return f"[{edge(lo)}, {edge(hi) if hi is not None else 'inf'}{']' if closed else ')'}"


def breakdown_tables(record: RunRecord) -> list[Table]:
    """|δ| by engine probability, each assistant turn (multi-turn runs), response length, position."""
    bd = record.breakdowns or {}
    p_infer = Table(
        "by_p_infer",
        "|δ| by engine probability",
        [Column("p_infer", "text"), Column("tokens"), Column("share"), Column("mean |δ|"), Column("p50")]
        + [Column("p90"), Column("p99"), Column("max"), Column("mean K3")],
        [
            Row(
                [_bucket(r["p_infer_lo"], r["p_infer_hi"], r["p_infer_hi"] == 1.0), fmt(r["count"]), pct(r["share"])]
                + [fmt(r.get(k)) for k in ("abs_delta_mean", "abs_delta_p50", "abs_delta_p90", "abs_delta_p99")]
                + [fmt(r.get("abs_delta_max")), fmt(r.get("k3_mean"))]
            )
            for r in bd.get("p_infer_buckets") or []
        ],
        lead="Mismatch concentrates on low-probability tokens (the numbers behind the figure).",
    )
    tables = [p_infer]
    by_index = record.metrics_by_turn_index or {}
    if len(by_index) > 1:
        keys = ("n_model_tokens", "n_sequences", "k3_kl", "prob_diff_mean", "prob_diff_max", "abs_delta_p99")
        tables.append(
            Table(
                "turns",
                "By assistant turn",
                [Column("turn", "text"), Column("model tokens"), Column("sample-turns"), Column("K3 KL")]
                + [Column("mean |Δp|"), Column("max |Δp|"), Column("p99 |δ|")]
                + [Column("log-ppl engine"), Column("log-ppl reference")],
                [
                    Row([t] + [fmt(m.get(k)) for k in (*keys, "log_ppl_infer", "log_ppl_train")])
                    for t, m in by_index.items()
                ],
                lead="Turn 0 answers the prompt; each later turn follows a tool response.",
            )
        )
    tables.append(
        Table(
            "by_length",
            "By response length",
            [Column("model tokens", "text"), Column("sequences"), Column("seq max mismatch (mean)")]
            + [Column("share > 0.5"), Column("seq mean mismatch")],
            [
                Row(
                    [_bucket(r["length_lo"], r["length_hi"]), fmt(r["count"]), fmt(r["seq_max_mismatch_mean"])]
                    + [pct(r["seq_max_mismatch_gt_0_5_share"]), fmt(r["seq_mean_mismatch_mean"])]
                )
                for r in bd.get("response_length_buckets") or []
            ],
        )
    )
    tables.append(
        Table(
            "by_position",
            "By token position",
            [Column("position", "text"), Column("tokens"), Column("mean |δ|"), Column("mean |Δp|")]
            + [Column("max |Δp|"), Column("mean K3")],
            [
                Row(
                    [_bucket(r["position_lo"], r["position_hi"]), fmt(r["count"])]
                    + [fmt(r[k]) for k in ("abs_delta_mean", "prob_diff_mean", "prob_diff_max", "k3_mean")]
                )
                for r in bd.get("position_buckets") or []
            ],
        )
    )
    return tables


def routing_tables(record: RunRecord) -> tuple[str, list[Table]]:
    """MoE routing agreement: a sentence and the tables behind it (none for a dense model)."""
    r = record.routing
    if not r or not r.get("n_tokens"):
        # an MoE model whose engine cannot return its routing: say why the section is missing
        why = record.engine.to_dict().get("routing_unavailable") if record.engine else None
        asked = (record.spec.engine.to_dict() if record.spec.engine else {}).get("record_routing", True)
        if not record.moe() or not why or not asked:
            return "", []
        lead = f"not measured: {why}"
        return lead, [Table("routing", "MoE routing agreement", [Column("", "text")], [Row([lead])])]
    lead = (
        f"Top-{r['top_k']} expert sets chosen for each model token's input, engine vs reference "
        f"({r.get('num_experts')} experts). A token flips when any layer picks another set; "
        f"{pct(r['tokens_with_flip_share'])} of tokens flipped."
    )
    replay, replay_table = routing_replay_view(record)
    if replay:
        lead += f" {replay}"
    keys = ("abs_delta_mean", "prob_diff_mean", "prob_diff_max", "k3_mean")
    tokens = Table(
        "routing",
        "MoE routing agreement",
        [Column("tokens", "text"), Column("count"), Column("mean |δ|"), Column("mean |Δp|"), Column("max |Δp|")]
        + [Column("mean K3")],
        [Row([name, fmt(r[name]["n_tokens"])] + [fmt(r[name][k]) for k in keys]) for name in ("flipped", "agreed")],
        lead=lead,
    )
    layers = Table(
        "routing_layers",
        "Routing agreement by layer",
        [Column("MoE layer", "text"), Column("same expert set"), Column("shared experts")],
        [
            Row([str(layer), fmt(a), fmt(o)])
            for layer, a, o in zip(r["moe_layers"], r["set_agreement_by_layer"], r["overlap_by_layer"])
        ],
    )
    return lead, [tokens, *([replay_table] if replay_table else []), layers]


def replay_sentence(replay: dict) -> str:
    """The routing replay what-if in one sentence: K3 with free routing, then replayed."""
    closed = replay.get("gap_closed_share")
    return f"Routing replay (R3): K3 free {fmt(replay.get('k3_free'))} -> replayed {fmt(replay.get('k3_replayed'))}" + (
        f" ({pct(closed)} of the gap closed)." if closed is not None else "."
    )


def routing_replay_view(record: RunRecord) -> tuple[str, Table | None]:
    """The routing replay (R3) what-if: a sentence for the routing lead and its table, per turn
    group and for the tokens whose routing flipped; or why it was not run (no table)."""
    r = record.routing or {}
    replay = r.get("replay")
    if not replay or not replay.get("n_tokens"):
        why = (record.reference.to_dict() if record.reference else {}).get("routing_replay")
        return (f"Routing replay (R3): {why}." if isinstance(why, str) and why.startswith("not run") else ""), None
    groups = [("all tokens", replay)]
    if labels.has_later_turns(record):
        groups += [
            (label, record.replay(key)) for key, label in (("first", labels.FIRST_TURN), ("later", labels.LATER_TURNS))
        ]
    groups.append(("tokens whose routing flipped", replay.get("flipped") or {}))
    table = Table(
        "routing_replay",
        "Routing replay (R3) what-if",
        [Column("tokens", "text"), Column("count"), Column("K3 free"), Column("K3 replayed")]
        + [Column("gap closed"), Column("mean |Δp| free"), Column("mean |Δp| replayed")],
        [
            Row(
                [name, fmt(g.get("n_tokens")), fmt(g.get("k3_free")), fmt(g.get("k3_replayed"))]
                + [pct(g.get("gap_closed_share")), fmt(g.get("prob_diff_mean_free"))]
                + [fmt(g.get("prob_diff_mean_replayed"))]
            )
            for name, g in groups
        ],
        lead=(
            "The engine against the reference routing freely, and against the reference with the routing behind "
            "each model token forced to the engine's experts (the router's own weights at them), over the same "
            "tokens: what turning on routing replay in the trainer would leave of the mismatch. "
            + replay_sentence(replay)
        ),
    )
    return replay_sentence(replay), table


def headline(record: RunRecord) -> list[Card]:
    m = record.metric
    mult = m("mult_prob_error")
    cards = [
        Card("K3 KL (mismatch-KL)", fmt(m("k3_kl")), k3_context(m("k3_kl"), labels.rollout_precision(record))),
        Card(
            "max token |Δp|",
            fmt(m("prob_diff_max")),
            f"mean {fmt(m('prob_diff_mean'))}{_paren(prob_diff_context(m('prob_diff_mean')))}; per-sequence max "
            f"averages {fmt(m('seq_max_mismatch_mean'))}",
        ),
        Card(
            "sequences with max |Δp| > 0.5",
            pct(m("seq_max_mismatch_gt_0_5_share")),
            f"{fmt(m('seq_max_mismatch_gt_0_5_count'))} of {fmt(m('n_sequences'))} sequences",
        ),
        Card("token mult. prob error", fmt(mult), _mult_note(mult, labels.rollout_precision(record))),
    ]
    prefill = record.decode_vs_prefill or {}
    if prefill.get("n_model_tokens"):
        cards.append(
            Card(
                "decode vs prefill K3",
                fmt(prefill.get("k3_kl")),
                "inside the engine: its sampled log-probs against its own full-sequence prefill",
            )
        )
    first_k3, later_k3 = m("k3_kl", "first"), m("k3_kl", "later")
    if labels.has_later_turns(record) and first_k3 and later_k3 is not None:
        cards.append(
            Card("later / first turn K3", ratio(later_k3, first_k3), f"first {fmt(first_k3)}, later {fmt(later_k3)}")
        )
    return cards


def _paren(note: str) -> str:
    return f" ({note})" if note else ""


def _mult_note(v, precision: str | None = None) -> str:
    if v is None:
        return ""
    line = (
        f"above NeMo-RL's {NEMO_RL_MULT_ERROR_THRESHOLD:g} threshold"
        if isinstance(v, str) or v > NEMO_RL_MULT_ERROR_THRESHOLD
        else f"below NeMo-RL's {NEMO_RL_MULT_ERROR_THRESHOLD:g} threshold (1.0 is perfect)"
    )
    if precision not in (None, "bf16", "fp32"):
        # the published per-precision figures are K3, K1 and Pearson (metric_docs.PUBLISHED_K3)
        line += f"; no multiplicative error has been published for {precision} rollouts"
    return line


TIMING_LABELS = {
    "setup_s": "setup",
    "engine_start_s": "engine start",
    "generation_s": "generation",
    "prefill_s": "engine prefill",
    "engine_stop_s": "engine stop",
    "reference_load_s": "reference load",
    "scoring_s": "reference scoring",
    "precision_s": "K3's interval after each round",
    "metrics_s": "metrics",
    "figures_s": "figures",
    "report_s": "report",
    "total_s": "total",
}


def timings_table(record: RunRecord) -> Table:
    """Where the run's time went (as far as the page knows it: :meth:`RunRecord.page_timings`)."""
    t = record.page_timings()
    total = t.get("total_s")
    return Table(
        "timings",
        "Timings",
        [Column("stage", "text"), Column("seconds"), Column("share")],
        [
            Row([TIMING_LABELS.get(k, k.removesuffix("_s")), seconds(v), pct(v / total) if total else "-"])
            for k, v in t.items()
        ],
    )


# token colour classes by |p_train - p_infer|: upper bounds of g0 .. g4, g5 above
GAP_CLASSES = (1e-4, 1e-3, 1e-2, 0.1, 0.5)


def gap_legend() -> list[tuple[str, str]]:
    bounds = [tick(b) for b in GAP_CLASSES]
    return (
        [("g0", f"< {bounds[0]}")]
        + [(f"g{k + 1}", f"{bounds[k]} – {bounds[k + 1]}") for k in range(len(bounds) - 1)]
        + [(f"g{len(bounds)}", f"≥ {bounds[-1]}")]
    )


def _gap_class(gap: float) -> str:
    for k, bound in enumerate(GAP_CLASSES):
        if gap < bound:
            return f"g{k}"
    return f"g{len(GAP_CLASSES)}"


def token_view(seq: dict) -> list[Span]:
    """The shown tokens of one worst sequence: text, colour class, hover title; a gap entry where
    tokens were left out."""
    t = seq["tokens"]
    texts = t.get("text")
    spans: list[Span] = []
    previous, seen_model = None, False
    for k, pos in enumerate(t["position"]):
        if previous is not None and pos > previous + 1:
            spans.append(Span(gap=pos - previous - 1))
        previous = pos
        tid = t["token_id"][k]
        text = texts[k] if texts is not None else f"⟨{tid}⟩"
        if t["is_model"][k]:
            seen_model = True
            p_i, p_t = t["p_infer"][k], t["p_train"][k]
            gap = abs(p_t - p_i)
            delta = math.log(p_t) - math.log(p_i) if p_t > 0 else -math.inf
            cls = _gap_class(gap) + (" wt" if pos == seq["worst_position"] else "")
            title = (
                f"p_infer {short(p_i)} · p_train {short(p_t)} · |Δp| {short(gap)} · δ {short(delta)} · "
                f"token {tid} · position {pos} · turn {t['turn'][k]}"
            )
        else:
            cls = "tool" if seen_model else "prompt"
            title = f"{'tool output' if seen_model else 'prompt'} token {tid} · position {pos} (not scored)"
        spans.append(Span(text if text != "" else "∅", cls, title))
    n_last = seq["n_tokens"] - 1
    if previous is not None and previous < n_last:
        spans.append(Span(gap=n_last - previous))
    return spans


def worst_table(worst: list[dict]) -> Table:
    return Table(
        "worst",
        "Worst sequences",
        [Column("sample", "text"), Column("prompt", "text"), Column("max |Δp|"), Column("at position")]
        + [Column("model tokens"), Column("tokens"), Column("turns"), Column("log-ratio Σδ")],
        [
            Row(
                [str(s["sample_id"]), str(s["prompt_id"]), fmt(s["max_prob_diff"]), fmt(s["worst_position"])]
                + [fmt(s["n_model_tokens"]), fmt(s["n_tokens"]), fmt(s["n_turns"]), fmt(s["log_ratio"])]
            )
            for s in worst
        ],
        lead="The samples whose largest token probability gap |p_train − p_infer| is biggest.",
    )


def stack_tables(record: RunRecord) -> list[Table]:
    """The known risks of the framework configuration the spec mirrors (`mismatch-probe init`), and
    its settings the probe could not mirror; none for a spec written by hand."""
    stack = record.spec.stack
    if not stack:
        return []
    framework = stack.get("framework", "")
    files = ", ".join(stack.get("config") or []) or "its defaults"
    commit = str(stack.get("commit") or "")[:7]
    pin = f" It pins {stack['engine_pin']}." if stack.get("engine_pin") else ""
    risks = stack.get("risks") or []
    risk_table = Table(
        "stack-risks",
        f"Known risks of this {framework} configuration",
        [Column("risk", "text"), Column("in this configuration", "long"), Column("evidence", "long")],
        [Row([r["title"], r["detail"], r["evidence"]]) for r in risks]
        or [Row(["none known"], note="no known risk matched this configuration")],
        lead=(
            f"The spec mirrors {framework}'s configuration from {files} ({framework}'s defaults at {commit} "
            f"for what it leaves unset; `mismatch-probe init`).{pin} Each risk below was found in that "
            "configuration before the run; the metrics below say how much it matters on this machine."
        ),
    )
    unmirrored = Table(
        "stack-unmirrored",
        f"{framework} settings the probe did not mirror",
        [Column("setting", "code"), Column("value", "code"), Column("why", "long")],
        [Row([u["key"], u["value"], u["why"]]) for u in stack.get("unmirrored") or []],
        lead="Set in the configuration, but with no probe setting that reproduces them.",
    )
    return [risk_table, unmirrored]


def dashboard_framework(record: RunRecord) -> str | None:
    """The framework whose dashboard the report shows: the one the spec mirrors (``[stack]``, from
    ``init`` or ``report --framework``), else the one whose dump the run was imported from."""
    stack = record.spec.stack or {}
    framework = stack.get("framework") or record.import_info().format
    return framework if framework in peer_frameworks() else None


def dashboard_rows(record: RunRecord, framework: str) -> list[dict[str, Any]]:
    """The "Your dashboard" table of ``framework`` as rows: each metric as the framework logs it, its
    value on this run, the probe's metric of the same value, the formula and where it is computed.
    ``Run.dashboard`` returns the same rows as a DataFrame."""
    values = (record.dashboard or {}).get(framework) or {}
    return [
        {
            "key": m.key,
            "value": values.get(m.key),
            "probe": m.probe,
            "probe_value": _probe_value(record, m.probe),
            "formula": m.formula,
            "source": m.source,
            "note": m.note,
        }
        for m in peer_metrics_of(framework)
    ]


def _probe_value(record: RunRecord, key: str | None) -> Any:
    """The probe's value of a metric or correction share (a peer metric's counterpart)."""
    if key is None:
        return None
    return record.metric(key) if key in (record.metrics or {}) else (record.corrections or {}).get(key)


def dashboard_table(record: RunRecord) -> Table | None:
    """Your dashboard: the named framework's own mismatch metrics on this run (analysis/peer_metrics.py)."""
    framework = dashboard_framework(record)
    if framework is None or not (record.dashboard or {}).get(framework):
        return None
    rows = dashboard_rows(record, framework)
    return Table(
        "dashboard",
        f"Your dashboard: {framework}",
        [
            Column(f"{framework} logs", "code"),
            Column("this run"),
            Column("the probe's", "code"),
            Column("formula", "long"),
            Column("computed as in", "long"),
        ],
        [
            Row(
                [
                    r["key"],
                    fmt(r["value"]),
                    f"{r['probe']} = {fmt(r['probe_value'])}" if r["probe"] else "",
                    r["formula"] + (f" ({r['note']})" if r["note"] else ""),
                    r["source"],
                ]
            )
            for r in rows
        ],
        lead=f"{framework}'s own mismatch metrics, computed on this run's tokens as {framework} computes them "
        "(the engine's log-probs as its rollout's, the reference's as its trainer's), so they compare with "
        "the numbers its training logs show. Keys with [...] are a variant its configuration selects.",
    )


def step_commands(record: RunRecord, path: Path) -> dict[str, str]:
    """The commands "What to do next" gives, with this run's directory as the run was given it."""
    spec = record.spec_file or "SPEC"
    path = labels.given_run_dir(record, path)
    return {
        "sweep_command": f"mismatch-probe sweep {path / NEXT_SWEEP}",
        "gate_command": f"mismatch-probe gate NEW_RUN --thresholds {path / SUGGESTED_GATE}",
        "spec_command": f"mismatch-probe compare {spec} --prefill-check --out {path}-decode-vs-prefill",
        "precision_command": f"mismatch-probe compare {spec} --out {path}-precision",
    }


def next_steps_table(record: RunRecord, path: Path) -> Table:
    """What to do next, from the run's own findings (analysis/next_steps.py), each citing its number;
    none for a sweep's point (the sweep's page connects its points into a decision)."""
    name = labels.run_label(record, path)
    point = sweep_of(path) is not None
    steps = (
        []
        if point
        else next_steps(record, labels.rollout_precision(record), run_name=name, **step_commands(record, path))
    )
    return Table(
        "next-steps",
        "What to do next",
        [
            Column("topic", "text"),
            Column("what this run shows", "long"),
            Column("next step", "long"),
            Column("command", "code"),
        ],
        [
            Row(
                [
                    s.topic,
                    s.finding,
                    s.action + (" (written beside this report)" if s.writes else ""),
                    s.command or "",
                ],
                muted=not s.urgent,
            )
            for s in steps
        ],
        lead="Each line is decided from this run's own numbers, which it cites; highlighted lines are problems.",
    )


def precision_table(record: RunRecord) -> Table | None:
    """An adaptive run's rounds (run.json's ``precision``): K3 and its interval after each, the samples
    the target was then expected to need; the lead says met, or not met and how many more samples."""
    state = record.precision or {}
    rounds = state.get("rounds") or []
    if not rounds:
        return None
    budget = state.get("budget") or {}
    outcome = outcome_line(state)
    limits = ", ".join(f"{k} {fmt(v)}" for k, v in budget.items() if v is not None)
    return Table(
        "precision",
        "Sample size",
        [
            Column("round", "text"),
            Column("samples"),
            Column("samples so far"),
            Column("model tokens so far"),
            Column("K3 KL"),
            Column(f"{pct(state.get('level', 0.95))} interval"),
            Column("± of K3"),
            Column("samples needed (estimated)"),
            Column("seconds so far"),
        ],
        [
            Row(
                [
                    str(r["round"]),
                    str(r["samples"]),
                    str(r["samples_total"]),
                    str(r["tokens_total"]),
                    fmt(r["k3_kl"]),
                    f"{fmt(r['low'])} – {fmt(r['high'])}",
                    percent(r["relative_half_width"]),
                    "-" if r.get("samples_needed") is None else str(r["samples_needed"]),
                    "-" if r.get("seconds_total") is None else seconds(r["seconds_total"]),
                ],
                muted=not r.get("met"),
            )
            for r in rounds
        ],
        lead=(
            (
                f"The rounds of {record.rollouts_source().run}, whose rollouts this run re-scores: the K3 below is "
                "that run's, which decided them. "
                if record.rollouts_from
                else ""
            )
            + f"{outcome[0].upper()}{outcome[1:]}. Sampled in rounds until K3's sequence-bootstrap interval was "
            f"within ±{percent(state['target'])} of K3 (--precision), within the budget ({limits}). A round adds "
            f"the samples the interval then asked for (its half-width shrinks as 1/√n) plus {pct(ROUND_MARGIN - 1)}, "
            f"at most {MAX_GROWTH}x those before it."
        ),
    )


def _run_rows(record: RunRecord) -> Pairs:
    samples = record.samples or {}
    reasons = ", ".join(f"{k} {v}" for k, v in (samples.get("finish_reasons") or {}).items())
    lengths = f"mean {fmt(samples.get('response_tokens_mean'))}, max {fmt(samples.get('response_tokens_max'))}"
    empty = fmt(samples.get("n_empty_responses"))
    rows = [
        ("created", f"{record.created_at} (completed {record.completed_at})"),
        ("samples", f"finish reasons: {reasons or '-'}; {empty} empty responses; response tokens {lengths}"),
    ]
    if record.tokenization_check:
        rows.append(("re-tokenization", ", ".join(f"{k} {v}" for k, v in record.tokenization_check.items())))
    if check := record.server_template_check:
        rows.append(("server's chat template", labels.server_template_summary(check)))
    return rows


def run_view(record: RunRecord, path: Path, dist: dict | None = None) -> RunView:
    """A run's pages, from its record and (for the worst sequences) its distributions."""
    worst = dist.get("worst_sequences") or [] if dist else []
    routing_lead, routing = routing_tables(record)
    name = labels.run_label(record, path)
    return RunView(
        kind="run",
        title=f"mismatch-probe: {name}",
        name=name,
        subtitle=f"{labels.engine_label(record)} vs {labels.reference_label(record)} on {labels.gpu_type(record)}",
        status=record.status,
        headline=headline(record),
        notes=labels.notes(record),
        setup=pairs(labels.setup_rows(record)),
        stack=stack_tables(record),
        precision=precision_table(record),
        # a re-scoring run's rounds are another run's, decided on that run's K3: its table says so
        precision_outcome=(
            outcome_line(record.precision or {})
            if (record.precision or {}).get("rounds") and not record.rollouts_from
            else ""
        ),
        next_steps=next_steps_table(record, path),
        dashboard=dashboard_table(record),
        metrics=metrics_table(record),
        corrections=corrections_table(record),
        breakdowns=breakdown_tables(record),
        routing=routing,
        routing_lead=routing_lead,
        figures=[info for info, _ in run_figure_list(record)],
        worst=worst_table(worst),
        worst_tokens=[token_view(seq) for seq in worst],
        worst_has_text=any(s["tokens"].get("text") is not None for s in worst),
        run=_run_rows(record),
        timings=timings_table(record),
        sync=sync_view(record),
    )
