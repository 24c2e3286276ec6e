"""The compiled pass (analysis/kernels.py) against the NumPy path, its oracle, on random shards and on
the edges (one token, one-token sequences, several turns, float32, p_train = 0, equal log-probs,
ratios that overflow, thresholds nothing or everything passes, no positions, an empty shard, the
values the contract refuses), then whole analyses: ``analyze`` of a run directory and a timeline
step's rows (``step_rows``), each computed both ways in one process.

What is asserted bitwise: what both paths compute from ``delta`` alone in the same order (counts,
token counts, the |delta| quantiles and their float32 bits, the p_infer buckets and the p_infer
table's count and |delta| rows, which both sum in token order, minima and maxima of |delta| and of
delta); every other float within 1e-12 relative: terms through exp (libm in the loop, NumPy's
SIMD exp in the oracle: an ulp apart) and sums in another order (sequential per segment against
pairwise)."""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest

from mismatch_probe.analysis import kernels, metrics
from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.analysis.metrics import BUCKET_KEYS, MetricsAccumulator, TokenStats
from mismatch_probe.analysis.peer_metrics import PeerAccumulator
from mismatch_probe.analysis.terms import SequenceTerms
from mismatch_probe.analysis.timeline import StepTokens, step_rows
from mismatch_probe.config.spec import CorrectionThresholds
from mismatch_probe.errors import DataError
from mismatch_probe.table.tokens import TOKENS_DIR, Rollout, shard_name, token_table, write_table_atomic

REL = 1e-12
# and an absolute floor at the rounding of 1: a value computed as a mean less 1 (chi2_token, per
# sequence too) is no closer to its exact value than that, whichever way it is summed
ABS = 1e-15


def exact_key(key: str) -> bool:
    """A value of run.json / steps.parquet both paths compute bit for bit (see the module): a count,
    a |delta| quantile or maximum, a bucket's edge."""
    return key.startswith("n_") or key.endswith(("count", "_p50", "_p90", "_p99", "abs_delta_max", "_lo", "_hi"))


@pytest.fixture
def numba_path(monkeypatch):
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    monkeypatch.setattr(kernels, "COMPILED_MIN_TOKENS", 0)  # the compiled loops, however few the tokens
    if kernels.compiled() is None:
        pytest.skip("numba is not installed or does not import here: the NumPy path runs alone")


def numpy_path(fn):
    """``fn()`` with the compiled loops turned off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.DISABLE_ENV, "1")
        assert kernels.compiled() is None
        return fn()


def close(got, want, path: str = "", exact: bool = False) -> None:
    """``got`` equals ``want``: bitwise where ``exact`` (or an integer), else within REL relative (or
    ABS); NaN equals NaN, an infinity only itself."""
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            close(got[k], want[k], f"{path}.{k}", exact or exact_key(str(k)))
    elif isinstance(want, list | tuple) and not isinstance(want, np.ndarray):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            close(a, b, f"{path}[{i}]", exact)
    elif isinstance(want, np.ndarray) or isinstance(got, np.ndarray):
        a, b = np.asarray(got), np.asarray(want)
        assert a.shape == b.shape, path
        if exact or b.dtype.kind in "iub":
            np.testing.assert_array_equal(a, b, err_msg=path)
        else:
            np.testing.assert_allclose(a, b, rtol=REL, atol=ABS, equal_nan=True, err_msg=path)
    elif isinstance(want, float) and not exact:
        assert isinstance(got, float), path
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=REL, abs=ABS), (path, got, want)
    else:
        assert got == want or (math.isnan(got) and math.isnan(want)), (path, got, want)


def assert_stats_equal(got: TokenStats, want: TokenStats, path: str) -> None:
    for f in dataclasses.fields(TokenStats):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if dataclasses.is_dataclass(b):  # Moments
            close(dataclasses.asdict(a), dataclasses.asdict(b), f"{path}.{f.name}", exact=False)
        else:
            close(a, b, f"{path}.{f.name}", exact=f.name in ("n", "counts"))
    for row in ("count", "abs_delta"):  # summed in token order both ways, of bitwise-equal values
        i = BUCKET_KEYS.index(row)
        np.testing.assert_array_equal(got.p_buckets[i], want.p_buckets[i], err_msg=f"{path}.p_buckets.{row}")
    np.testing.assert_array_equal(got.pos_buckets[0], want.pos_buckets[0], err_msg=f"{path}.pos_buckets.count")


def shard(
    seed: int,
    n_seq: int = 30,
    *,
    turns: int = 1,
    dtype=np.float64,
    one_token: bool = False,
    extreme: bool = False,
):
    """(lt, li, starts, positions, turn) of sequences of 1-400 tokens (``one_token``: each of one)."""
    rng = np.random.default_rng(seed)
    lengths = np.ones(n_seq, np.int64) if one_token else rng.integers(1, 400, n_seq)
    n = int(lengths.sum())
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    pos = np.arange(n) - np.repeat(starts, lengths) + np.repeat(rng.integers(0, 40000, n_seq), lengths)
    within = (np.arange(n) - np.repeat(starts, lengths)) / np.repeat(lengths, lengths)
    turn = np.minimum((within * turns).astype(np.int16), turns - 1)
    li = np.log(rng.beta(5, 0.3, n))
    lt = np.where(rng.random(n) < 0.2, li, li + rng.normal(0, 0.05, n)).clip(max=0)
    if extreme:
        lt[rng.random(n) < 0.01] = -np.inf  # p_train = 0
        # the ratio overflows to inf (even sequences) or underflows to 0 (odd ones): not both in one
        # sequence, whose log-ratio would cancel 799 - 799 to below either path's rounding of it
        odd = np.repeat(np.arange(n_seq) % 2 == 1, lengths)
        pick = rng.random(n) < 0.01
        li[pick & ~odd], lt[pick & ~odd] = -800.0, -1.0
        lt[pick & odd], li[pick & odd] = -800.0, -1.0
        tiny = rng.random(n) < 0.01
        lt[tiny] = li[tiny] * (1 + 1e-15)  # |delta| near the rounding of the log-probs
    return lt.astype(dtype), li.astype(dtype), starts, pos, turn.astype(np.int16)


def both(fn):
    """``fn()`` compiled and under the NumPy path."""
    return fn(), numpy_path(fn)


def accumulate(shards, thresholds=None, positions: bool = True, turns: bool = True):
    acc = MetricsAccumulator(thresholds or CorrectionThresholds())
    peers = PeerAccumulator(thresholds or CorrectionThresholds())
    done = []
    for lt, li, starts, pos, turn in shards:
        d = acc.add(lt, li, starts, pos if positions else None, turn if turns else None)
        if d is not None:
            peers.add_shard(lt, li, starts, d)
        done.append(d)
    return acc, peers, done


def assert_accumulators_equal(got, want) -> None:
    (acc_c, peers_c, done_c), (acc_n, peers_n, done_n) = got, want
    assert acc_c.turns == acc_n.turns
    for t in acc_n.turns:
        assert_stats_equal(acc_c._cells[t], acc_n._cells[t], f"turn {t}")
    for i, (c, n) in enumerate(zip(done_c, done_n)):
        assert (c is None) == (n is None)
        if n is None:
            continue
        for name in SequenceTerms._fields:  # per sequence
            exact = name in ("n_tokens", "min_token_log_ratio")
            close(getattr(c.sequences, name), getattr(n.sequences, name), f"shard {i} sequences.{name}", exact)
        np.testing.assert_array_equal(c.segments, n.segments)
        assert c.peers is not None and n.peers is None  # the loop's share of the peer metrics
    for a, b in zip(acc_c._abs_delta, acc_n._abs_delta):
        np.testing.assert_array_equal(a, b, err_msg="float32 |delta| bits")
    for a, b in zip(acc_c._p_bucket, acc_n._p_bucket):
        np.testing.assert_array_equal(a, b, err_msg="p_infer buckets")
    peer_c, peer_n = peers_c.stats(), peers_n.stats()
    assert peer_c.n == peer_n.n
    exact_tok = {"abs_delta_max", "abs_delta_min", "oob_tis", "oob_icepop"}
    for k, v in peer_n.tok.items():
        close(peer_c.tok[k], v, f"peer tok {k}", exact=k in exact_tok)
    close(peer_c.seq, peer_n.seq, "peer seq")
    groups = ["all", "first", "later", *acc_n.turns]
    for g in groups:
        close(acc_c.metrics(g), acc_n.metrics(g), f"metrics({g})")
        close(acc_c.corrections(g), acc_n.corrections(g), f"corrections({g})")
        close(acc_c.breakdowns(g), acc_n.breakdowns(g), f"breakdowns({g})")
    close(peers_c.result(), peers_n.result(), "dashboard")


CASES = {
    "single turn": {"shards": [shard(1), shard(2)]},
    "four turns": {"shards": [shard(3, turns=4), shard(4, turns=4)]},
    "float32": {"shards": [shard(5, turns=2, dtype=np.float32), shard(6, dtype=np.float32)]},
    "one-token sequences": {"shards": [shard(7, 200, one_token=True)]},
    "one token": {"shards": [shard(8, 1, one_token=True)]},
    "one long sequence": {"shards": [shard(9, 1)]},
    "p_train = 0, overflow, underflow, equal": {"shards": [shard(10, extreme=True), shard(11, turns=3, extreme=True)]},
    "nothing clipped or masked": {
        "shards": [shard(12)],
        "thresholds": CorrectionThresholds(token_tis=1e9, token_mask_low=1e-9, token_mask_high=1e9),
    },
    "everything clipped or masked": {
        # every delta in [0.3, 0.7] (an sd at the rounding of the values would compare rounding alone)
        "shards": [(lt, lt - np.linspace(0.3, 0.7, len(lt)), *rest) for lt, _, *rest in [shard(13)]],
        "thresholds": CorrectionThresholds(token_tis=1 + 1e-9, token_mask_low=1 - 1e-9, token_mask_high=1 + 1e-9),
    },
    "no positions, no turns": {"shards": [shard(14), shard(15)], "positions": False, "turns": False},
    "an empty shard": {"shards": [shard(16), tuple(np.zeros(0, dt) for dt in (float, float, int, int, np.int16))]},
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_pass_equals_the_numpy_path(numba_path, case):
    kw = CASES[case]
    got, want = both(lambda: accumulate(**kw))
    assert_accumulators_equal(got, want)


@pytest.mark.parametrize(
    "case", ["four turns", "float32", "one-token sequences", "p_train = 0, overflow, underflow, equal"]
)
def test_a_shard_in_blocks_gives_one_loops_bits(numba_path, monkeypatch, case):
    """The loop runs a shard block by block (kernels.BLOCK_TOKENS, cut where a sequence begins)
    into one state, in token order: the same bits as one block, whatever the block's size."""
    kw = CASES[case]
    assert all(len(lt) < kernels.BLOCK_TOKENS for lt, *_ in kw["shards"])
    whole = accumulate(**kw)
    monkeypatch.setattr(kernels, "BLOCK_TOKENS", 300)  # blocks of one to a few sequences (of 1-400 tokens)
    blocked = accumulate(**kw)
    (acc_b, peers_b, done_b), (acc_w, peers_w, done_w) = blocked, whole
    for t in acc_w.turns:
        close(dataclasses.asdict(acc_b._cells[t]), dataclasses.asdict(acc_w._cells[t]), f"turn {t}", exact=True)
    for b, w in zip(done_b, done_w, strict=True):
        close(b.sequences._asdict(), w.sequences._asdict(), "sequences", exact=True)
        close(tuple(b.peers), tuple(w.peers), "peers", exact=True)
    close(acc_b._abs_delta, acc_w._abs_delta, "|delta| bits", exact=True)
    close(acc_b._p_bucket, acc_w._p_bucket, "p_infer buckets", exact=True)
    for g in ["all", "first", "later", *acc_w.turns]:
        close(acc_b.metrics(g), acc_w.metrics(g), f"metrics({g})", exact=True)
        close(acc_b.breakdowns(g), acc_w.breakdowns(g), f"breakdowns({g})", exact=True)
    close(peers_b.result(), peers_w.result(), "dashboard", exact=True)


@pytest.mark.parametrize(
    "bad", [("logp_train", np.nan), ("logp_infer", np.nan), ("logp_train", np.inf), ("logp_infer", -np.inf)]
)
def test_refused_values_raise_the_numpy_paths_error(numba_path, bad):
    lt, li, starts, pos, turn = shard(20)
    (lt if bad[0] == "logp_train" else li)[17] = bad[1]
    messages = []
    for run in (lambda f: f(), numpy_path):
        with pytest.raises(DataError) as err:
            run(lambda: MetricsAccumulator().add(lt, li, starts, pos, turn))
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def conversation(sample_id: int, turns: list, rng) -> tuple[Rollout, np.ndarray]:
    """A sample of prompt, tool and assistant tokens (``turns``: (kind, n), kind 'prompt', 'tool' or
    an assistant turn index)."""
    ids, turn, model = [], [], []
    for kind, n in turns:
        ids += list(rng.integers(3, 1000, n))
        turn += [kind if isinstance(kind, int) else -1] * n
        model += [isinstance(kind, int)] * n
    model = np.array(model)
    li = np.where(model, np.log(rng.uniform(0.01, 1, len(ids))), np.nan).astype(np.float32)
    lt = np.where(model, li + rng.normal(0, 0.05, len(ids)), np.nan).clip(max=0).astype(np.float32)
    li[~model] = -50.0
    rollout = Rollout(sample_id, f"p{sample_id}", np.array(ids, np.int32), np.array(turn, np.int16), model, li, "stop")
    return rollout, lt


def test_analyze_gives_the_same_run_metrics_both_ways(numba_path, tmp_path):
    rng = np.random.default_rng(0)
    sample = 0
    for i in range(3):
        shard_rows = []
        for _ in range(12):
            shape = [("prompt", 20), (0, int(rng.integers(1, 300)))]
            if sample % 3:
                shape += [("tool", 7), (1, int(rng.integers(1, 200))), ("tool", 3), (2, int(rng.integers(1, 50)))]
            shard_rows.append(conversation(sample, shape, rng))
            sample += 1
        rollouts, lts = [r for r, _ in shard_rows], [lt for _, lt in shard_rows]
        table = token_table(rollouts, lts, [np.zeros(len(x), np.float32) for x in lts])
        write_table_atomic(table, tmp_path / TOKENS_DIR / shard_name(i))
    got, want = both(lambda: analyze(tmp_path))
    assert got["metrics"]["n_model_tokens"] > 1000
    close(got, want, "analyze")


def test_a_timeline_step_gives_the_same_rows_both_ways(numba_path):
    lt, li, starts, pos, turn = shard(30, 60, turns=2)
    sample_id = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(lt))))
    tokens = StepTokens(sample_id, turn, pos, li, lt, n_samples=len(starts) + 2)
    got, want = both(lambda: step_rows(7, tokens, n_boot=200))
    assert [r["group"] for r in got] == ["all", "first", "later"]
    close(got, want, "step_rows")


def test_the_numpy_path_runs_when_numba_is_refused_or_absent(monkeypatch):
    lt, li, starts, pos, turn = shard(40, turns=2)
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    assert kernels.compiled() is None
    refused = MetricsAccumulator()
    assert refused.add(lt, li, starts, pos, turn).known_terms is not None  # the NumPy path's terms
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")  # "0" is not a refusal
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.setattr(kernels, "_COMPILED", {})
    assert kernels.compiled() is None
    absent = MetricsAccumulator()
    absent.add(lt, li, starts, pos, turn)
    close(absent.metrics(), refused.metrics(), "metrics", exact=True)


def test_numba_stays_out_of_the_import_of_the_analysis():
    import subprocess

    code = (
        "import sys, mismatch_probe.analysis.analyze, mismatch_probe.analysis.timeline; print('numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_key_the_numpy_path_gains_and_the_loop_lacks_fails_in_one_line(numba_path, monkeypatch):
    monkeypatch.setattr(metrics, "SUM_KEYS", (*metrics.SUM_KEYS, "k4"))
    lt, li, starts, pos, turn = shard(50)
    with pytest.raises(NotImplementedError, match="^the compiled pass computes no k4: add it to analysis/kernels.py$"):
        MetricsAccumulator().add(lt, li, starts, pos, turn)
