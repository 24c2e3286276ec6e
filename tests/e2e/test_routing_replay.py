"""Routing replay (R3) end to end: the reference scoring with the engine's routing forced, packed
and padded, against an independent forced forward of each sequence alone; and ``compare`` on the
MoE fixture with the HF engine (bf16 against an fp32 reference, where routing flips), whose what-if
reaches run.json, the per-token table and every rendering of the report."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import MOE, SINGLE_TURN, cli
from reference_checks import RAW, make_rollouts

from mismatch_probe.analysis.terms import token_terms
from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.errors import DataError
from mismatch_probe.modeling.routing import ForcedRouting
from mismatch_probe.reference.scorer import ReferenceScorer


def _engine_routing(rollouts, seed: int) -> None:
    """Distinct sorted expert ids per model token and MoE layer, as an engine records them."""
    rng = np.random.default_rng(seed)
    for r in rollouts:
        ids = [np.sort(rng.choice(8, 2, replace=False)) for _ in range(r.n_model_tokens * 4)]
        r.experts_infer = np.array(ids, np.int16).reshape(r.n_model_tokens, 4, 2)


def _forced_alone(model, r) -> np.ndarray:
    """Independent: one sequence through the model's own forward, the row before each model token
    forced to its engine experts; log-softmax in float64."""
    rows = torch.from_numpy(np.flatnonzero(r.is_model_token) - 1)
    with torch.inference_mode(), ForcedRouting(model).force(rows, torch.from_numpy(r.experts_infer.astype(np.int64))):
        logits = model(input_ids=torch.from_numpy(r.token_ids.astype(np.int64))[None]).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return lp[rows, torch.from_numpy(r.token_ids[r.is_model_token].astype(np.int64))].numpy()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_replayed_scores_are_the_forced_forward_of_each_sequence_alone(packing):
    rollouts = make_rollouts(6, seed=4)  # one has a tool block inside its response
    scorer = ReferenceScorer(MOE, ReferenceSpec(dtype="float32", packing=packing, micro_batch_size=3))
    assert scorer.routing_replay_unavailable() is None
    _engine_routing(rollouts, seed=0)
    free = scorer.score(rollouts, RAW)
    assert free.logp_replay is None  # only when asked
    # the engine routed exactly as the reference does: replaying it changes nothing, bit for bit
    for r, own in zip(rollouts, free.experts):
        r.experts_infer = own
    same = scorer.score(rollouts, RAW, replay=True)
    for a, b in zip(same.logp, same.logp_replay):
        assert np.array_equal(a, b, equal_nan=True)
    # other experts: what a forced forward of the sequence alone gives
    _engine_routing(rollouts, seed=1)
    scores = scorer.score(rollouts, RAW, replay=True)
    moved = []
    for r, lp, lr in zip(rollouts, scores.logp, scores.logp_replay):
        assert np.isnan(lr[~r.is_model_token]).all()
        assert np.abs(lr[r.is_model_token] - _forced_alone(scorer.model, r)).max() < 2e-5
        moved.append(np.abs(lr - lp)[r.is_model_token])
    assert np.concatenate(moved).mean() > 0.01
    # the engine's ids must fit the reference's MoE layers
    for r in rollouts:
        r.experts_infer = r.experts_infer[:, :3]
    with pytest.raises(DataError, match="4 MoE layers"):
        scorer.score(rollouts, RAW, replay=True)
    scorer.close()


ARGS = ("--prompts", str(SINGLE_TURN), "--max-tokens", "48", "--n", "2", "--max-prompts", "16", "--seed", "7")


@pytest.fixture(scope="module")
def bf16_moe_run(tmp_path_factory):
    """compare on the MoE fixture: the hf engine in bf16 against an fp32 reference (routing flips)."""
    out = tmp_path_factory.mktemp("replay") / "bf16"
    args = ("--out", str(out), "--engine-dtype", "bfloat16", "--train-dtype", "float32")
    proc = cli("compare", "--model", str(MOE), *ARGS, *args)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_compare_reports_the_routing_replay_what_if(bf16_moe_run):
    out, terminal = bf16_moe_run
    rec = json.loads((out / "run.json").read_text())
    routing, replay = rec["routing"], rec["routing"]["replay"]
    # the flips carry the mismatch
    assert 0 < routing["tokens_with_flip_share"] < 0.5
    assert routing["flipped"]["abs_delta_mean"] > 2 * routing["agreed"]["abs_delta_mean"]
    t = pq.read_table(out / "tokens.parquet", columns=["is_model_token", "experts_infer"])
    model = t.column("is_model_token").to_numpy(zero_copy_only=False)
    assert t.column("experts_infer").is_null().to_numpy(zero_copy_only=False).tolist() == (~model).tolist()
    assert rec["reference"]["routing_replay"] == "the engine's experts forced (R3)"
    assert replay["n_tokens"] == routing["n_tokens"] == rec["metrics"]["n_model_tokens"]
    assert replay["k3_free"] == pytest.approx(rec["metrics"]["k3_kl"], rel=1e-9)
    assert routing["flipped"]["n_tokens"] == replay["flipped"]["n_tokens"] > 0  # routing flips here
    assert replay["k3_replayed"] <= replay["k3_free"]
    assert replay["flipped"]["k3_replayed"] < replay["flipped"]["k3_free"] / 2  # replay is for those
    assert routing["by_turn"]["first"]["replay"] == replay  # single turn: the first turn is all of it
    # the what-if is the per-token table's, in float64
    t = pq.read_table(
        out / "tokens.parquet", columns=["is_model_token", "logp_infer", "logp_train", "logp_train_replay"]
    )
    model = t.column("is_model_token").to_numpy(zero_copy_only=False)
    lr = t.column("logp_train_replay").to_numpy(zero_copy_only=False)
    assert np.isnan(lr[~model]).all() and not np.isnan(lr[model]).any()
    li, lt = (t.column(c).to_numpy(zero_copy_only=False)[model] for c in ("logp_infer", "logp_train"))
    assert replay["k3_replayed"] == pytest.approx(token_terms(lr[model], li).k3.mean(), rel=1e-9)
    assert replay["k3_free"] == pytest.approx(token_terms(lt, li).k3.mean(), rel=1e-9)
    # every rendering says it, from the one view model
    sentence = "Routing replay (R3): K3 free"
    assert sentence in " ".join(terminal.split())
    md = (out / "report.md").read_text()
    assert "## Routing replay (R3) what-if" in md and sentence in md and "## MoE routing agreement" in md
    assert "Routing replay (R3) what-if" in (out / "report.html").read_text()
