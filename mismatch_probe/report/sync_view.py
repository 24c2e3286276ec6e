"""The weight-sync probe's part of a run's pages (``record.sync``, ARCHITECTURE.md, Weight sync):
the verdict and its findings, each sync of the same weights, the stale-cache and fresh-engine
comparisons, the engine's own report of the last sync, the timings. Part of the run's view
(:mod:`.run_view`); nothing here computes a number."""

from __future__ import annotations

from dataclasses import dataclass

from mismatch_probe.analysis.sync import STALE_FLOOR_FACTOR
from mismatch_probe.numbers import fmt, pct, seconds
from mismatch_probe.record import RunRecord
from mismatch_probe.report import labels
from mismatch_probe.report.view import Column, Pairs, Row, Table, pairs


@dataclass
class SyncView:
    """The weight-sync probe's part of a run's pages (``record.sync``): the verdict, each sync of the
    same weights, the stale-cache and fresh-engine comparisons, the engine's own report of the last
    sync, the timings."""

    clean: bool
    verdict: str
    findings: list[str]  # each finding's message
    setup: Pairs
    repeats: Table
    stale_cache: Table  # no rows when the run did not measure it
    vs_fresh: Table
    engine_report: Pairs
    timings: Table


SYNC_NAMES_SHOWN = 4  # differing parameters named in a sync's row (all of them are in run.json)


def _seconds(value) -> str:
    return seconds(value) if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _differing(weights: dict) -> str:
    """A sync's parameters that differ from a fresh load, the first few by name; or why they were
    not compared."""
    if "unavailable" in weights:
        return f"not compared: {weights['unavailable']}"
    names, compared = weights.get("differing"), weights.get("compared")
    if names is None:
        return "-"
    of = f" of {fmt(compared)}" if compared is not None else ""
    if not names:
        return f"none{of}"
    shown = ", ".join(map(str, names[:SYNC_NAMES_SHOWN]))
    more = f", … {len(names) - SYNC_NAMES_SHOWN} more" if len(names) > SYNC_NAMES_SHOWN else ""
    return f"{len(names)}{of}: {shown}{more}"


def sync_view(record: RunRecord) -> SyncView | None:
    """The weight-sync probe's section, or None for a run that did not sync."""
    sync = record.sync
    if sync is None:
        return None
    repeats = sync.get("repeats") or []
    rows = []
    for k, r in enumerate(repeats):
        report, fid, weights = r.get("report") or {}, r.get("fidelity") or {}, r.get("weights") or {}
        rows.append(
            Row(
                [str(r.get("repeat", k + 1)), str(report.get("transfer") or "-"), fmt(report.get("buckets"))]
                + [fmt(report.get("bytes")), _seconds(report.get("seconds"))]
                + [fmt(fid.get("tokens")), pct(fid.get("bitwise_share")), fmt(fid.get("max_abs_dlogp"))]
                + [fmt(fid.get("k3")), _differing(weights)]
            )
        )
    repeats_table = Table(
        "sync_repeats",
        "Each sync of the same weights",
        [Column("sync", "text"), Column("transfer", "text"), Column("buckets"), Column("bytes"), Column("seconds")]
        + [Column("tokens"), Column("bitwise share"), Column("max |Δ log p|"), Column("K3")]
        + [Column("differing parameters", "text")],
        rows,
        lead="The synced engine's prefill log-probs against a fresh engine's (loaded from the same weights) on "
        "the same tokens in the same requests and batches, and its parameters against the fresh engine's: the "
        "error the sync path adds.",
    )
    stale = sync.get("stale_cache") or {}
    floor = stale.get("floor") or {}
    stale_table = Table(
        "sync_stale_cache",
        "Stale prefix cache",
        [Column("tokens"), Column("bitwise share"), Column("max |Δ log p|"), Column("K3")]
        + [Column("floor: max |Δ log p|")],
        [
            Row(
                [fmt(stale.get("tokens")), pct(stale.get("bitwise_share"))]
                + [fmt(stale.get("max_abs_dlogp")), fmt(stale.get("k3")), fmt(floor.get("max_abs_dlogp"))]
            )
        ]
        if stale
        else [],
        lead="The same greedy requests decoded with the prefix cache holding entries computed with the weights "
        "the engine started from, against after a reset, on the tokens both chose alike; the floor is what a "
        "cache hit alone changes on this engine and machine (the same requests from the reset cache's new "
        f"entries, against recomputed), which a stale cache must exceed {STALE_FLOOR_FACTOR:g}x to be a finding.",
    )
    fresh = sync.get("vs_fresh") or {}
    interval = fresh.get("interval")
    within = fresh.get("within_noise")
    fresh_table = Table(
        "sync_vs_fresh",
        "Synced vs fresh engine, against the reference",
        [Column("tokens"), Column("K3 synced"), Column("K3 fresh"), Column("difference"), Column("interval", "text")]
        + [Column("within noise", "text")],
        [
            Row(
                [fmt(fresh.get("tokens")), fmt(fresh.get("k3_synced")), fmt(fresh.get("k3_fresh"))]
                + [fmt(fresh.get("difference"))]
                + [f"[{fmt(interval[0])}, {fmt(interval[1])}]" if interval and len(interval) == 2 else "-"]
                + ["-" if within is None else "yes" if within else "no"]
            )
        ]
        if fresh
        else [],
        lead="Mismatch (K3) against the reference of the synced engine's prefill and of a fresh engine's on the "
        "same tokens; the interval of the difference is a sequence bootstrap, within noise when it covers 0.",
    )
    timings = sync.get("timings") or {}
    timing_rows = [
        Row([label, _seconds(timings[key])]) for key, label in labels.SYNC_TIMING_LABELS.items() if key in timings
    ]
    timing_rows += [Row([f"sync {k + 1}", _seconds(t)]) for k, t in enumerate(timings.get("sync_s") or [])]
    timing_rows += [
        Row([key.removesuffix("_s").replace("_", " "), _seconds(v)])
        for key, v in timings.items()
        if key not in labels.SYNC_TIMING_LABELS and key != "sync_s"
    ]
    clean, verdict = labels.sync_verdict(sync)
    last = (repeats[-1].get("report") or {}) if repeats else {}
    return SyncView(
        clean=clean,
        verdict=verdict,
        findings=labels.sync_findings(sync),
        setup=pairs(labels.sync_setup_rows(sync)),
        repeats=repeats_table,
        stale_cache=stale_table,
        vs_fresh=fresh_table,
        engine_report=pairs(labels.sync_engine_report(last)) if last else [],
        timings=Table("sync_timings", "Weight sync timings", [Column("step", "text"), Column("seconds")], timing_rows),
    )
