"""The report's distributions against independent NumPy computations, streamed in shards."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyarrow as pa
import pytest

from mismatch_probe.analysis.distributions import (
    LENGTH_EDGES,
    LOG_RATIO_EDGES,
    MISMATCH_LOG_EDGES,
    PROB_BINS,
    SEQ_MAX_MISMATCH_EDGES,
    DistributionAccumulator,
    dense,
    load,
    save,
    with_sequences,
    worst_sequences,
)
from mismatch_probe.analysis.metrics import MetricsAccumulator
from mismatch_probe.analysis.sequences import SCHEMA, SequenceIds, sequence_table
from mismatch_probe.analysis.terms import segment_starts
from mismatch_probe.table.tokens import TOKEN_SCHEMA, TOKENS_DIR, shard_name, write_table_atomic


def synthetic(seed=0, n_seq=60):
    """Model tokens of ``n_seq`` sequences (2 turns each), with a few p_train = 0 and p = 1 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, n_seq)
    sample = np.repeat(np.arange(n_seq), lengths)
    turn = np.concatenate([(np.arange(k) >= k // 2).astype(np.int16) for k in lengths])
    li = np.log(rng.beta(2, 0.5, len(sample)))
    lt = li + rng.normal(0, 0.05, len(sample)) * rng.random(len(sample)) ** 4
    lt = np.minimum(lt, 0.0)
    lt[5], li[7], lt[7] = -np.inf, 0.0, 0.0
    return sample, turn, lt, li


def accumulate(sample, turn, lt, li, cuts):
    """The token-level distributions streamed in shards, joined with the sequence level computed
    from the per-sequence rows the metrics pass keeps (sequences.parquet), as the report does."""
    acc = DistributionAccumulator(worst_k=5)
    groups = {g: (SequenceIds(), MetricsAccumulator()) for g in ("all", "first", "later")}
    bounds = [0, *cuts, len(sample)]
    for a, b in itertools.pairwise(bounds):
        s, t, x, y = sample[a:b], turn[a:b], lt[a:b], li[a:b]
        acc.add(x, y, s, t)
        for g, keep in (("all", np.ones(len(s), bool)), ("first", t == 0), ("later", t >= 1)):
            if not keep.any():
                continue
            starts = segment_starts(s[keep]) if g == "all" else segment_starts(s[keep], t[keep])
            groups[g][0].add(s[keep], None if g == "all" else t[keep], starts)
            groups[g][1].add(x[keep], y[keep], starts)
    return with_sequences(acc.finish(), sequence_table(groups))


def test_histograms_match_numpy_and_do_not_depend_on_sharding():
    sample, turn, lt, li = synthetic()
    # shard cuts on sequence boundaries, as the table's shards are
    starts = segment_starts(sample)
    one = accumulate(sample, turn, lt, li, [])
    sharded = accumulate(sample, turn, lt, li, [int(starts[10]), int(starts[33])])
    assert one == sharded

    p_t, p_i = np.exp(lt), np.exp(li)
    edges = np.linspace(0, 1, PROB_BINS + 1)
    for g, keep in (("first", turn == 0), ("later", turn >= 1)):
        expect, _, _ = np.histogram2d(p_i[keep], p_t[keep], bins=[edges, edges])
        assert (dense(one["groups"][g]["prob_hist"]) == expect).all()
        finite = LOG_RATIO_EDGES.copy()
        finite[0], finite[-1] = -1e300, 1e300
        delta = np.where(np.isneginf(lt), -1e299, lt - li)[keep]
        expect, _ = np.histogram(delta, bins=finite)
        assert one["groups"][g]["log_ratio_hist"] == expect.tolist()
        assert one["groups"][g]["n_tokens"] == int(keep.sum())
    assert one["groups"]["first"]["log_ratio_hist"][0] == 1  # the p_train = 0 token (first turn)


def test_sequence_histograms_and_worst_samples_match_brute_force():
    sample, turn, lt, li = synthetic(seed=1)
    dist = accumulate(sample, turn, lt, li, [])
    gap = np.abs(np.exp(lt) - np.exp(li))
    seq_max = np.array([gap[sample == s].max() for s in range(sample.max() + 1)])
    seq_len = np.bincount(sample)
    seq_ratio = np.array([(lt - li)[sample == s].sum() for s in range(sample.max() + 1)])
    expect, _ = np.histogram(seq_max, bins=SEQ_MAX_MISMATCH_EDGES)
    assert dist["sequences"]["max_mismatch_hist"] == expect.tolist()
    assert dist["sequences"]["n_sequences"] == len(seq_max)
    expect2d, _, _ = np.histogram2d(seq_len, np.maximum(seq_max, 0), bins=[LENGTH_EDGES, MISMATCH_LOG_EDGES])
    assert (dense(dist["sequences"]["length_vs_max_mismatch"]) == expect2d).all()
    assert sum(dist["sequences"]["log_ratio_hist"]) == len(seq_ratio)
    assert dist["sequences"]["log_ratio_hist"][0] == int(np.isneginf(seq_ratio).sum()) == 1
    order = np.argsort(-seq_max, kind="stable")[:5]
    assert [w["sample_id"] for w in dist["worst"]] == order.tolist()
    assert [w["max_prob_diff"] for w in dist["worst"]] == pytest.approx(seq_max[order].tolist(), abs=0)


@pytest.mark.parametrize("cut", [None, 3, 7])
def test_tied_worst_samples_keep_the_lowest_sample_ids_whatever_the_shards(cut):
    """Ten samples of one token each, eight with the same gap: the worst five are the two larger
    gaps, then the tied ones by sample id, in one shard or two (the example run has such ties, and
    NumPy 1.26 and 2 kept different ones of them while the pruning did not break ties)."""
    gap_of = np.array([0.25, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.7, 0.25])
    sample = np.array([6, 3, 9, 0, 8, 1, 5, 2, 4, 7])  # not in id order, as no shard need be
    li = np.log(np.full(10, 0.9))
    lt = np.log(0.9 - gap_of[sample])
    acc = DistributionAccumulator(worst_k=5)
    for part in np.split(np.arange(10), [cut] if cut else []):
        acc.add(lt[part], li[part], sample[part], np.zeros(len(part), np.int16))
    assert [w["sample_id"] for w in acc.finish()["worst"]] == [8, 1, 0, 2, 3]


def test_empty_run_gives_empty_distributions():
    acc = DistributionAccumulator()
    acc.add(np.zeros(0), np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int16))
    dist = with_sequences(acc.finish(), SCHEMA.empty_table())
    assert dist["worst"] == [] and dist["sequences"]["n_sequences"] == 0
    assert sum(dist["sequences"]["max_mismatch_hist"]) == 0 and dense(dist["groups"]["first"]["prob_hist"]).sum() == 0
    assert dist["groups"]["later"]["log_ppl_infer"] == []


def write_run(run_dir, lengths, worst_at, prompt_len=10):
    """A token table of sequences with ``prompt_len`` prompt tokens each; in sequence k the model
    token at position ``worst_at[k]`` has p_infer 0.9 against p_train 0.3, all others agree."""
    ids, tables = [], []
    for k, (n, w) in enumerate(zip(lengths, worst_at)):
        model = np.arange(n) >= prompt_len
        li = np.where(model, np.log(0.5), np.nan).astype(np.float32)
        lt = li.copy()
        li[w], lt[w] = np.log(0.9), np.log(0.3)
        tables.append(
            pa.Table.from_arrays(
                [
                    pa.array(np.full(n, k, np.int64)),
                    pa.array([f"p<{k}>"] * n),
                    pa.array(np.where(model, 0, -1).astype(np.int16)),
                    pa.array(np.arange(n, dtype=np.int32)),
                    pa.array((np.arange(n) % 50 + 100).astype(np.int32)),
                    pa.array(model),
                    pa.array(li, mask=~model),
                    pa.array(lt, mask=~model),
                    pa.nulls(n, pa.float32()),
                    pa.nulls(n, pa.float32()),
                    pa.nulls(n, pa.binary()),
                    pa.nulls(n, pa.binary()),
                    pa.nulls(n, pa.float32()),  # logp_trainer
                    pa.nulls(n, pa.float32()),  # logp_train_replay
                ],
                schema=TOKEN_SCHEMA,
            )
        )
        ids.append(k)
    write_table_atomic(pa.concat_tables(tables), run_dir / TOKENS_DIR / shard_name(0))


class CharTokenizer:
    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def test_worst_sequences_show_the_head_and_a_window_around_the_worst_token(tmp_path):
    write_run(tmp_path, lengths=[1000, 30], worst_at=[700, 12])
    worst = [{"sample_id": 0, "max_prob_diff": 0.6}, {"sample_id": 1, "max_prob_diff": 0.6}]
    long, short = worst_sequences(tmp_path, worst, CharTokenizer(), head=48, window=320)
    assert long["worst_position"] == 700 and long["max_prob_diff"] == pytest.approx(0.6, abs=1e-6)
    assert long["tokens"]["position"] == list(range(48)) + list(range(540, 860))
    assert long["n_tokens"] == 1000 and long["n_model_tokens"] == 990 and long["prompt_id"] == "p<0>"
    assert long["tokens"]["text"][:2] == [chr(100), chr(101)]
    assert long["tokens"]["is_model"][:11] == [False] * 10 + [True]
    assert math.isnan(long["tokens"]["p_infer"][0]) and long["tokens"]["p_train"][700 - 540 + 48] == pytest.approx(0.3)
    assert long["log_ratio"] == pytest.approx(math.log(0.3 / 0.9), rel=1e-6)
    assert short["tokens"]["position"] == list(range(30))  # short: everything

    from mismatch_probe.report.run_view import token_view

    spans = token_view(long)
    gaps = [s.gap for s in spans if s.gap]
    assert gaps == [540 - 48, 1000 - 860]
    outlined = [s for s in spans if "wt" in s.cls]
    assert len(outlined) == 1 and "p_infer 0.9 · p_train 0.3" in outlined[0].title and "g5" in outlined[0].cls
    assert spans[0].cls == "prompt"
    no_text = worst_sequences(tmp_path, worst[1:], None)[0]
    assert no_text["tokens"]["text"] is None and token_view(no_text)[0].text == "⟨100⟩"


def test_saved_distributions_load_back_with_their_infinities(tmp_path):
    sample, turn, lt, li = synthetic(seed=2)
    dist = accumulate(sample, turn, lt, li, [])
    write_run(tmp_path, lengths=[20], worst_at=[15])
    dist["worst_sequences"] = worst_sequences(tmp_path, [{"sample_id": 0, "max_prob_diff": 0.6}])
    save(tmp_path, {**dist, "version": 1})  # version 1: token and sequence level in one file
    back = load(tmp_path)
    assert back["edges"]["log_ratio"][0] == -math.inf and back["edges"]["log_ratio"][-1] == math.inf
    assert back["groups"] == dist["groups"] and back["sequences"] == dist["sequences"]
    points = back["groups"]["first"]["log_ppl_train"] + back["groups"]["later"]["log_ppl_train"]
    assert math.inf in points  # the p_train = 0 sequence
    save(tmp_path, {k: v for k, v in dist.items() if k != "sequences"})  # version 2: token level
    assert load(tmp_path)["version"] == 2
    assert math.isnan(back["worst_sequences"][0]["tokens"]["p_infer"][0])
    (tmp_path / "distributions.json").write_text('{"version": 0}')
    assert load(tmp_path) is None  # an older format is recomputed, not misread
