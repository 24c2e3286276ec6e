"""verl's rollout cache read by a timeline as flat columns (the padded tensors gathered at once,
``dumps/verl.py: _flat``) gives what reading each sample through ``to_rollout`` gives: the same
model tokens bit for bit, and for a bad sample the same error naming it. (The generic format's
Parquet batches: tests/unit/test_step_reading.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from required import unavailable
from synthetic_run import synthetic_run
from training_run import verl_site, write_verl

from mismatch_probe.dumps.verl import VerlDump
from mismatch_probe.errors import ConfigError
from mismatch_probe.timeline import dump_steps
from mismatch_probe.timeline.dump_steps import DumpSource, read_step

BAD_SAMPLE = 13


@pytest.fixture(autouse=True)
def _verl():
    if verl_site() is None:
        unavailable("VERL", "verl is not installed for the tests: bash tests/dumps/install-verl.sh .verl-site")


def read(source: DumpSource, monkeypatch, *, one_at_a_time: bool):
    with monkeypatch.context() as m:
        if one_at_a_time:  # every sample through to_rollout alone
            m.setattr(VerlDump, "sample_columns", lambda self: None)
            m.setattr(dump_steps._Chunk, "add", lambda self, k, sample: False)
        else:
            m.setattr(dump_steps, "_read_samples", None)  # the flat columns alone, or this fails
        try:
            return read_step(source, 2)
        except ConfigError as exc:
            return exc


def test_a_verl_step_reads_flat_as_one_sample_at_a_time_does(tmp_path, monkeypatch):
    (step,) = synthetic_run(1, n_sequences=40).values()
    source = DumpSource("verl", str(write_verl(step, tmp_path, old_log_probs=True)), trust_pickle=True)
    got, want = (read(source, monkeypatch, one_at_a_time=one) for one in (False, True))
    for name in ("sample_id", "turn", "position", "logp_infer", "logp_train"):
        a, b = getattr(got.tokens, name), getattr(want.tokens, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert got.tokens.n_samples == want.tokens.n_samples == 40
    assert set(got.tokens.turn) == {0, 1}  # the tool's output inside every other response
    assert got.notes == want.notes and got.notes


@pytest.mark.parametrize("bad", ["trainer log-prob NaN", "engine log-prob above 0"])
def test_a_bad_verl_sample_is_refused_with_one_sample_at_a_times_error(tmp_path, monkeypatch, bad):
    (step,) = synthetic_run(1, n_sequences=40).values()
    s = step.sequences[BAD_SAMPLE]
    at = np.flatnonzero(s.model_mask)[3]
    if bad == "trainer log-prob NaN":
        s.logp_trainer[at] = np.nan
    else:
        s.logp_engine[at] = 0.5
    source = DumpSource("verl", str(write_verl(step, tmp_path, old_log_probs=True)), trust_pickle=True)
    want = read(source, monkeypatch, one_at_a_time=True)
    got = read_step_or_error(source)
    assert isinstance(want, ConfigError) and f"sample {BAD_SAMPLE}" in str(want), want
    assert isinstance(got, ConfigError)
    assert (str(got), got.hint) == (str(want), want.hint)


def read_step_or_error(source: DumpSource):
    try:
        return read_step(source, 2)
    except ConfigError as exc:
        return exc
