"""A Monitor inside a real training loop equals the timeline of that loop's own dumps.

The loop is examples/monitor_plain_loop.py on the fixture model: a bfloat16 engine samples, the
float32 trainer recomputes the log-probs of the same tokens and takes an optimizer step, the weights
go back to the engine. Each step is logged to a Monitor and also written as a generic dump
(``step_<N>.parquet``, as tests/dumps/training_run.py writes one); ``mismatch-probe timeline`` over
those dumps must give the monitor's steps.parquet, every column, NaN for NaN.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pyarrow.parquet as pq
from conftest import ROOT
from dumps.training_run import Sequence, Step, write_generic

from mismatch_probe.timeline.runner import TimelineOptions, build_timeline

STEPS = 3


def plain_loop():
    spec = importlib.util.spec_from_file_location("monitor_plain_loop", ROOT / "examples" / "monitor_plain_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def dump_step(directory, step, batch) -> None:
    """The step as the generic dump: one row per sequence, padding stripped, log-probs at their tokens."""
    sequences = []
    for b in range(len(batch.token_ids)):
        keep = batch.attention[b].numpy()
        mask = batch.mask[b].numpy()[keep]
        sequences.append(
            Sequence(
                prompt_id=batch.prompt_ids[b],
                prompt_len=int(np.argmax(mask)),
                token_ids=batch.token_ids[b].numpy()[keep].astype(np.int64),
                model_mask=mask,
                logp_engine=np.where(mask, batch.logp_infer[b].numpy()[keep], np.nan).astype(np.float32),
                logp_trainer=np.where(mask, batch.logp_train[b].numpy()[keep], np.nan).astype(np.float32),
            )
        )
    write_generic(Step(sequences), directory / f"step_{step}.parquet")


def test_the_monitor_of_a_training_loop_equals_the_import_of_its_dumps(tmp_path):
    dumps = tmp_path / "dumps"
    monitored = plain_loop().train(
        tmp_path / "monitor", steps=STEPS, on_step=lambda step, batch: dump_step(dumps, step, batch), flush_every=2
    )
    imported = build_timeline(
        TimelineOptions(format="generic", source=str(dumps), out=str(tmp_path / "imported"), workers=1, keep="none")
    )
    assert not imported.failed and imported.analysed == list(range(STEPS))
    mine, theirs = pq.read_table(monitored / "steps.parquet"), pq.read_table(imported.out / "steps.parquet")
    assert mine.schema == theirs.schema and mine.num_rows == theirs.num_rows >= STEPS
    for name in mine.column_names:
        a, b = mine.column(name).to_pylist(), theirs.column(name).to_pylist()
        assert [v is None for v in a] == [v is None for v in b], name
        if name == "group":
            assert a == b
        else:  # NaN-aware: a metric a step cannot have is NaN or null on both sides alike
            np.testing.assert_array_equal(np.array(a, dtype=float), np.array(b, dtype=float), err_msg=name)
    # the loop moved the weights between steps: the steps differ, and the mismatch is bf16's, not zero
    k3 = [r["k3_kl"] for r in mine.to_pylist() if r["group"] == "all"]
    assert len(set(k3)) == STEPS and all(0 < v < 0.05 for v in k3)
    record = json.loads((monitored / "timeline.json").read_text())
    assert record["source"] == {"format": "monitor", "path": "monitor", "model": None}
    assert record["steps"]["count"] == STEPS and record["drift"] == imported.record.model_dump(mode="json")["drift"]
    # one sampled-sequence file per step, each holding at most the 8 sequences asked for
    files = sorted((monitored / "sequences").glob("step-*.parquet"))
    assert len(files) == STEPS
    assert all(len(pq.read_table(f).column("sample_id").unique()) == 8 for f in files)
