"""The routing replay (R3) what-if without a model: its sums against float64
(``analysis/routing_replay.py: ReplayAccumulator``), how the report shows it (or why it was not run), and
when the score stage asks the reference for it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MOE

from mismatch_probe.analysis.routing_replay import ReplayAccumulator
from mismatch_probe.analysis.terms import token_terms
from mismatch_probe.record import RunRecord
from mismatch_probe.report.run_view import routing_tables


def test_replay_what_if_sums_are_the_float64_means():
    rng = np.random.default_rng(3)
    n = 1000
    li = np.log(rng.uniform(0.01, 1, n)).astype(np.float32)
    lt = (li + rng.normal(0, 0.05, n)).astype(np.float32)
    lr = (li + rng.normal(0, 0.02, n)).astype(np.float32)
    flipped = rng.uniform(size=n) < 0.1
    keep = rng.uniform(size=n) < 0.7
    acc = ReplayAccumulator()
    half = n // 2  # streamed in two parts
    for part in (slice(0, half), slice(half, n)):
        acc.add(token_terms(lt[part], li[part]), token_terms(lr[part], li[part]), flipped[part], keep[part])
    r = acc.result()

    def by_hand(a, b, sel):
        d = a.astype(np.float64)[sel] - b.astype(np.float64)[sel]
        p = np.abs(np.exp(a.astype(np.float64)[sel]) - np.exp(b.astype(np.float64)[sel]))
        return float(np.mean(np.exp(d) - d - 1)), float(p.mean())

    for got, sel in ((r, keep), (r["flipped"], keep & flipped)):
        (k3f, pf), (k3r, pr) = by_hand(lt, li, sel), by_hand(lr, li, sel)
        assert got["n_tokens"] == int(sel.sum())
        assert got["k3_free"] == pytest.approx(k3f, rel=1e-9) and got["k3_replayed"] == pytest.approx(k3r, rel=1e-9)
        assert got["gap_closed_share"] == pytest.approx(1 - k3r / k3f, rel=1e-9)
        assert got["prob_diff_mean_free"] == pytest.approx(pf, rel=1e-9)
        assert got["prob_diff_mean_replayed"] == pytest.approx(pr, rel=1e-9)
    empty = ReplayAccumulator().result()
    assert empty["n_tokens"] == 0 and empty["k3_free"] is None and empty["flipped"]["gap_closed_share"] is None


def _record(replay: dict | None, reference: dict | None = None) -> RunRecord:
    group = {"n_tokens": 10, "abs_delta_mean": 0.1, "prob_diff_mean": 0.01, "prob_diff_max": 0.1, "k3_mean": 0.01}
    routing = {
        "moe_layers": [0, 1],
        "top_k": 2,
        "num_experts": 8,
        "n_tokens": 20,
        "set_agreement_by_layer": [0.9, 1.0],
        "overlap_by_layer": [0.95, 1.0],
        "tokens_with_flip_share": 0.5,
        "flipped": group,
        "agreed": group,
    }
    if replay is not None:
        routing["replay"] = replay
    return RunRecord.model_validate(
        {"routing": routing, "reference": reference or {}, "architecture": {"moe": True}, "status": "complete"}
    )


def test_the_report_shows_the_what_if_or_why_it_was_not_run():
    flipped = {"n_tokens": 3, "k3_free": 0.01, "k3_replayed": 0.001, "gap_closed_share": 0.9}
    replay = {"n_tokens": 20, "k3_free": 0.004, "k3_replayed": 0.001, "gap_closed_share": 0.75, "flipped": flipped}
    lead, tables = routing_tables(_record(replay))
    assert "Routing replay (R3): K3 free 0.0040 -> replayed 0.0010 (75% of the gap closed)." in lead
    assert [t.id for t in tables] == ["routing", "routing_replay", "routing_layers"]
    rows = {r.cells[0]: r.cells for r in tables[1].rows}
    assert rows["all tokens"][1:5] == ["20", "0.0040", "0.0010", "75%"]
    assert rows["tokens whose routing flipped"][4] == "90%"
    why = "not run: the reference runs as rank processes"
    lead, tables = routing_tables(_record(None, {"routing_replay": why}))
    assert lead.endswith(f"Routing replay (R3): {why}.") and "routing_replay" not in [t.id for t in tables]
    lead, _ = routing_tables(_record(None))
    assert "Routing replay" not in lead


def test_the_score_stage_replays_with_a_single_process_reference_only():
    from mismatch_probe.config.spec import ProbeSpec
    from mismatch_probe.reference.scorer import replay_info, routing_replay

    assert routing_replay(False, object()) is None and replay_info(None) == {}
    why = routing_replay(True, object())  # the rank processes' scorer (SP, TP, FSDP) stands here
    assert why.startswith("the reference runs as rank processes")
    assert replay_info(why) == {"routing_replay": f"not run: {why}"}
    assert replay_info(True) == {"routing_replay": "the engine's experts forced (R3)"}
    # on by default, and at its default in no fingerprint: runs recorded before it still resume
    spec = ProbeSpec(model=str(MOE), prompts="p.jsonl")
    off = spec.model_copy(update={"reference": spec.reference.model_copy(update={"routing_replay": False})})
    assert spec.reference.routing_replay and "routing_replay" not in spec.dump()["reference"]
    assert off.fingerprint() != spec.fingerprint()
