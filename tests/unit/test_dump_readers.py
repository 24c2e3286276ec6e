"""Each format's reader on the committed example dumps (examples/dumps/), and the import command
in-process: what each reader yields, the refusals, and that reading verl's pickle needs no verl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.dumps import get_format, open_dump
from mismatch_probe.dumps.samples import to_rollout
from mismatch_probe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DUMPS = ROOT / "examples" / "dumps"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"


def read(fmt: str, path: Path, **kw):
    reader = open_dump(get_format(fmt), path, **kw)
    return reader, list(reader.samples())


def test_the_four_example_dumps_hold_the_same_step():
    readers = {
        "slime": read("slime", DUMPS / "slime"),
        "nemo-rl": read("nemo-rl", DUMPS / "nemo-rl"),
        "verl": read("verl", DUMPS / "verl", trust_pickle=True),
        "generic": read("generic", DUMPS / "generic" / "step.parquet"),
        "generic-jsonl": read("generic", DUMPS / "generic" / "step.jsonl"),
    }
    checked = {
        name: [to_rollout(x, i, vocab_size=1024) for i, x in enumerate(samples)]
        for name, (_, samples) in readers.items()
    }
    base = checked["generic"]
    assert len(base) == 8
    for name, (reader, _) in readers.items():
        assert reader.step in (None, 3), name
        assert len(checked[name]) == 8, name
        for a, b in zip(checked[name], base):
            n = len(b.rollout.token_ids)  # NeMo-RL's rows end with the environment's message
            assert a.rollout.token_ids[:n].tolist() == b.rollout.token_ids.tolist(), name
            assert a.rollout.is_model_token[:n].tolist() == b.rollout.is_model_token.tolist(), name
            assert a.rollout.turn[:n].tolist() == b.rollout.turn.tolist(), name
            np.testing.assert_array_equal(a.rollout.logp_infer[:n], b.rollout.logp_infer)
            np.testing.assert_array_equal(a.logp_trainer[:n], b.logp_trainer)
    assert "verl" not in sys.modules and "tensordict" not in sys.modules  # read without them


def test_slime_finds_its_train_dump_or_is_told_where():
    reader, samples = read("slime", DUMPS / "slime" / "rollout_data" / "3.pt")
    assert reader.train_file == DUMPS / "slime" / "train_data" / "3.pt" and samples[0].logp_trainer is not None
    with pytest.raises(ConfigError, match="--train-dump"):
        read("slime", DUMPS / "slime", trainer_path=DUMPS / "nope.pt")
    with pytest.raises(
        ConfigError, match=r"has no slime rollout dumps \(rollout_data/<id>.pt\) of step 4 \(its steps: 3\)"
    ):
        read("slime", DUMPS / "slime", step=4)


def test_verl_needs_the_flag_and_the_generic_format_its_columns(tmp_path):
    with pytest.raises(ConfigError, match=r"is a pickle .* \(pass --trust-pickle"):
        read("verl", DUMPS / "verl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"token_ids": [[1, 2, 3]], "logp_engine": [[-1.0]]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match=r"x.parquet lacks the column\(s\) model_mask"):
        read("generic", tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="neither Parquet nor JSON Lines"):
        read("generic", DUMPS / "slime" / "rollout_data" / "3.pt")


def test_import_in_process_writes_a_run_and_refuses_bad_input(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    generic = ["import", "generic", str(DUMPS / "generic" / "step.jsonl"), "--model", str(MODEL)]
    result = runner.invoke(app, [*generic, "--out", str(out), "--temperature", "0.7"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "run.json").read_text())
    assert record["imported_from"]["settings_from"]["sampling.temperature"] == "flag"
    assert record["spec"]["sampling"]["temperature"] == 0.7 and record["logprob_semantics"]["matched"] is True
    assert record["imported_from"]["samples"] == 8 and (out / "tokens.parquet").is_dir()
    bad = runner.invoke(app, ["import", "slimey", str(DUMPS), "--model", str(MODEL)])
    assert bad.exit_code == 2 and "unknown dump format 'slimey'" in bad.output
    other = runner.invoke(app, [*generic, "--out", str(out), "--set", "engine.dtype=float32"])
    assert other.exit_code == 2 and "only [reference] and [corrections]" in other.output
    args = [*generic, "--out", str(tmp_path / "x")]
    bad = runner.invoke(app, [*args, "--trainer-logprobs", "logits"])
    assert bad.exit_code == 2 and "--trainer-logprobs 'logits': choose one of raw, temperature, processed" in bad.output
    for flag in ("--logprobs-mode", "--engine-logprobs"):  # the spec's flag, and import's spelling of it
        bad = runner.invoke(app, [*args, flag, "sampled"])
        assert bad.exit_code == 2 and "--logprobs-mode must be one of raw, processed, got 'sampled'" in bad.output
    bad = runner.invoke(app, [*args, "--train-dtype", "int3"])  # a [reference] flag, from the spec's declaration
    assert bad.exit_code == 2 and "--train-dtype must be one of" in bad.output
    assert not (tmp_path / "x").exists()


def test_a_trainer_that_scores_another_distribution_is_said(tmp_path):
    """verl's vLLM returns processed log-probs (top-p applied) and its actor scores logits / T only:
    with top-p < 1 the two sides differ by design, and the report says so."""
    from mismatch_probe.importing import ImportOptions, import_dump
    from mismatch_probe.report.labels import notes

    options = ImportOptions(trust_pickle=True, flags={"sampling.temperature": 0.8, "sampling.top_p": 0.9})
    ctx = import_dump("verl", DUMPS / "verl", model=MODEL, out=tmp_path / "run", options=options)
    sem = ctx.record.logprob_semantics
    assert sem.engine.distribution == "log_softmax(top_p(logits / temperature))"
    assert sem.reference.distribution == "log_softmax(logits / temperature)" and sem.matched is False
    assert any("the trainer's log-probs are of log_softmax(logits / temperature)" in n for n in notes(ctx.record))
