"""A timeline step read the fast ways (Parquet's batches as flat columns; samples gathered in
chunks) gives what reading every sample through ``to_rollout`` gives: the same model tokens, bit
for bit, and for a bad row the same error, to the word, naming the same row."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.dumps.generic import PARQUET_BATCH_ROWS, GenericDump
from mismatch_probe.errors import ConfigError
from mismatch_probe.timeline import dump_steps
from mismatch_probe.timeline.dump_steps import DumpSource, read_step

VOCAB = 1000
N_ROWS = 2 * PARQUET_BATCH_ROWS + 100  # three Parquet batches, three chunks
BAD_ROW = PARQUET_BATCH_ROWS + 44  # in the second batch


def rows(seed: int, *, compact: bool = False, bool_mask: bool = False) -> list[dict]:
    """Samples of a prompt then assistant turns with tool output between them; log-probs full length
    (null off the model tokens) or, ``compact``, one per model token."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(N_ROWS):
        mask = [False] * int(rng.integers(1, 20))
        for _ in range(int(rng.integers(1, 4))):
            mask += [True] * int(rng.integers(1, 30)) + [False] * int(rng.integers(0, 5))
        n = len(mask)
        engine = np.log(rng.uniform(0.01, 1, n))
        trainer = np.minimum(engine + rng.normal(0, 0.05, n), 0)
        m = np.array(mask)

        def logp(v, m=m):
            return [float(x) for x in v[m]] if compact else [float(x) if on else None for x, on in zip(v, m)]

        out.append(
            {
                "token_ids": [int(x) for x in rng.integers(0, VOCAB, n)],
                "model_mask": mask if bool_mask else [int(x) for x in mask],
                "logp_engine": logp(engine),
                "logp_trainer": logp(trainer),
                "prompt_id": f"p{k // 4}",
            }
        )
    return out


def write(tmp_path, data: list[dict], suffix: str):
    path = tmp_path / f"dump{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(data), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    return DumpSource("generic", str(path), vocab_size=VOCAB)


def one_at_a_time(source: DumpSource, monkeypatch):
    """read_step with every sample through to_rollout alone: no batches, no chunks."""
    with monkeypatch.context() as m:
        m.setattr(GenericDump, "sample_columns", lambda self: None)
        m.setattr(dump_steps._Chunk, "add", lambda self, k, sample: False)
        return outcome(source)


def outcome(source: DumpSource):
    try:
        return read_step(source, 0)
    except ConfigError as exc:
        return exc


def assert_same(got, want) -> None:
    if isinstance(want, Exception):
        assert isinstance(got, ConfigError), got
        assert (str(got), got.hint) == (str(want), want.hint)
        return
    assert not isinstance(got, Exception), got
    for name in ("sample_id", "turn", "position", "logp_infer", "logp_train"):
        a, b = getattr(got.tokens, name), getattr(want.tokens, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert got.tokens.n_samples == want.tokens.n_samples == N_ROWS


def with_columns_used(monkeypatch) -> list:
    """Records each batch whose flat columns read_step took (its first sample's number)."""
    taken: list = []
    batch_tokens = dump_steps._batch_tokens

    def spy(batch, k0, vocab_size):
        got = batch_tokens(batch, k0, vocab_size)
        if got is not None:
            taken.append(k0)
        return got

    monkeypatch.setattr(dump_steps, "_batch_tokens", spy)
    return taken


GOOD = {
    "full length": {},
    "one per model token": {"compact": True},
    "boolean masks": {"bool_mask": True},
}


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("case", list(GOOD))
def test_a_good_step_reads_as_one_sample_at_a_time_does(tmp_path, monkeypatch, suffix, case):
    source = write(tmp_path, rows(1, **GOOD[case]), suffix)
    want = one_at_a_time(source, monkeypatch)
    taken = with_columns_used(monkeypatch)
    assert_same(outcome(source), want)
    # Parquet's every batch as flat columns; JSON Lines has none (its samples go in chunks)
    assert taken == ([0, PARQUET_BATCH_ROWS, 2 * PARQUET_BATCH_ROWS] if suffix == ".parquet" else [])
    assert want.tokens.turn.max() >= 2  # several turns a sample, told apart by the mask alone


def mixed_counts(data):
    data[BAD_ROW]["logp_engine"] = [x for x in data[BAD_ROW]["logp_engine"] if x is not None]  # one row compact


def given_turns(data):
    for r in data:
        r["turn"] = None
    mask = np.array(data[BAD_ROW]["model_mask"], bool)
    data[BAD_ROW]["turn"] = [0 if on else -1 for on in mask]  # one run of turn 0, however many runs


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("unusual", [mixed_counts, given_turns], ids=["mixed counts", "turns given"])
def test_an_unusual_row_takes_the_careful_path_for_its_batch_alone(tmp_path, monkeypatch, suffix, unusual):
    data = rows(2)
    unusual(data)
    source = write(tmp_path, data, suffix)
    want = one_at_a_time(source, monkeypatch)
    taken = with_columns_used(monkeypatch)
    assert_same(outcome(source), want)
    assert taken == ([0, 2 * PARQUET_BATCH_ROWS] if suffix == ".parquet" else [])


def first_token_sampled(r):
    r["model_mask"][0] = 1
    r["logp_engine"][0] = r["logp_trainer"][0] = -0.5


def id_past_vocabulary(r):
    r["token_ids"][3] = VOCAB


def engine_nan(r):
    r["logp_engine"][r["model_mask"].index(1)] = float("nan")


def trainer_positive(r):
    r["logp_trainer"][r["model_mask"].index(1)] = 0.5


def wrong_count(r):
    r["logp_trainer"] = r["logp_trainer"][:-1]


def no_trainer(r):
    r["logp_trainer"] = None


def no_token_ids(r):
    r["token_ids"] = None


def one_token(r):
    for k in ("token_ids", "model_mask", "logp_engine", "logp_trainer"):
        r[k] = r[k][:1]


BAD = [
    first_token_sampled,
    id_past_vocabulary,
    engine_nan,
    trainer_positive,
    wrong_count,
    no_trainer,
    no_token_ids,
    one_token,
]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("bad", BAD, ids=lambda f: f.__name__)
def test_a_bad_row_is_refused_with_one_sample_at_a_times_error(tmp_path, monkeypatch, suffix, bad):
    data = rows(3)
    bad(data[BAD_ROW])
    source = write(tmp_path, data, suffix)
    want = one_at_a_time(source, monkeypatch)
    got = outcome(source)
    assert_same(got, want)
    assert isinstance(got, ConfigError) and f"row {BAD_ROW}" in str(got), got


def test_a_step_without_model_tokens_is_refused_as_the_sample_reader_refuses_it(tmp_path, monkeypatch):
    data = rows(4)
    for r in data:
        r["model_mask"] = [0] * len(r["model_mask"])
        r["logp_engine"] = r["logp_trainer"] = []
    source = write(tmp_path, data, ".parquet")
    want = one_at_a_time(source, monkeypatch)
    assert isinstance(want, ConfigError) and "none of the step's" in str(want)
    assert_same(outcome(source), want)
