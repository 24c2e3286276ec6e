"""mismatch_probe.Monitor on arrays: its rows are step_rows' of the same tokens whatever the input's
form (padded or per sequence, torch or NumPy, in the caller's thread or a worker's), it writes
nothing on other ranks, takes steps in any order, continues a directory, keeps a bounded number
of sequences per step, and exports the step's metrics to TensorBoard and W&B."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT

from mismatch_probe import Monitor
from mismatch_probe.analysis.timeline import StepTokens, step_rows
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.timeline import runner, store
from mismatch_probe.timeline.monitor import EXPORTED, MONITOR, SEQUENCE_SCHEMA


def batch(seed: int, b: int = 12, t: int = 40, *, two_turns: bool = True) -> dict[str, np.ndarray]:
    """A padded batch: prompts of varying length, responses right-padded, every third sequence with a
    tool's output (not generated) between two turns; log-probs off the mask are garbage."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, (b, t))
    mask = np.zeros((b, t), bool)
    for i in range(b):
        start, end = 4 + i % 5, t - (i * 3) % 11
        mask[i, start:end] = True
        if two_turns and i % 3 == 0:
            mask[i, start + 6 : start + 9] = False
    li = (np.log(rng.uniform(0.05, 1.0, (b, t))) * 0.5).astype(np.float32)
    lt = np.minimum(li + rng.normal(0, 0.02, (b, t)).astype(np.float32), 0)
    li[~mask] = np.nan  # never read
    lt[~mask] = 99.0
    return {"token_ids": ids, "logp_infer": li, "logp_train": lt, "mask": mask}


def log(monitor: Monitor, step: int, arrays: dict, **kw):
    return monitor.log_step(step, arrays["token_ids"], arrays["logp_infer"], arrays["logp_train"], arrays["mask"], **kw)


def steps_table(out: Path):
    return store.consolidate(out)


def as_lists(arrays: dict) -> dict[str, list[np.ndarray]]:
    """The same batch as a list of sequences, each cut at its last generated token plus a few."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in arrays}
    for i in range(len(arrays["mask"])):
        end = int(np.flatnonzero(arrays["mask"][i])[-1]) + 1 + i % 3
        for k, v in arrays.items():
            out[k].append(v[i, :end])
    return out


def equal_tables(a, b) -> None:
    """Every column equal, nulls in the same places, NaN equal to NaN."""
    assert a.schema == b.schema and a.num_rows == b.num_rows
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        assert [v is None for v in x] == [v is None for v in y], name
        if isinstance(next((v for v in x if v is not None), None), float):
            np.testing.assert_array_equal(np.array(x, dtype=float), np.array(y, dtype=float), name)
        else:
            assert x == y, name


def test_a_step_row_is_step_rows_of_its_generated_tokens(tmp_path):
    arrays = batch(0)
    with Monitor(tmp_path / "t", sample_sequences=0) as mon:
        row = log(mon, 7, arrays)
        m = arrays["mask"]
        rows, cols = np.nonzero(m)
        starts = m & ~np.pad(m, ((0, 0), (1, 0)))[:, :-1]
        turn = (np.cumsum(starts, 1) - 1)[m]
        tokens = StepTokens(
            sample_id=rows,
            turn=turn.astype(np.int16),
            position=cols,
            logp_infer=arrays["logp_infer"][m].astype(np.float64),
            logp_train=arrays["logp_train"][m].astype(np.float64),
            n_samples=len(m),
        )
        expected = step_rows(7, tokens)
        assert row == expected[0]
        assert {r["group"] for r in expected} == {"all", "first", "later"}
        assert row["n_samples"] == 12 and row["n_model_tokens"] == int(m.sum())
    written = pq.read_table(tmp_path / "t" / "steps.parquet").to_pylist()
    assert written == expected
    assert (
        pq.read_schema(tmp_path / "t" / "steps" / "step-00000007.parquet").metadata[store.FINGERPRINT_KEY] == b"monitor"
    )
    record = json.loads((tmp_path / "t" / "timeline.json").read_text())
    assert record["source"]["format"] == MONITOR and record["status"] == "complete" and record["steps"]["count"] == 1
    assert (tmp_path / "t" / "timeline.html").is_file()


def test_padded_batches_lists_torch_and_numpy_give_the_same_rows_and_sequences(tmp_path):
    arrays = batch(1)
    lists = as_lists(arrays)
    forms = {
        "padded numpy": arrays,
        "lists numpy": lists,
        "padded torch": {k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()},
        "lists torch": {k: [torch.from_numpy(np.asarray(s)) for s in v] for k, v in lists.items()},
        # the trainer's float64 / bfloat16-safe values, the mask as 0/1 floats
        "padded torch f64": {
            **{k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()},
            "logp_train": torch.from_numpy(arrays["logp_train"].astype(np.float64)),
            "mask": torch.from_numpy(arrays["mask"].astype(np.float32)),
        },
    }
    rows, sequences = {}, {}
    for name, form in forms.items():
        out = tmp_path / name.replace(" ", "-")
        mon = Monitor(out, sample_sequences=4, flush_every=100)
        rows[name] = log(mon, 3, form)
        sequences[name] = pq.read_table(out / "sequences" / "step-00000003.parquet")
    first = next(iter(rows.values()))
    assert all(r == first for r in rows.values())
    # a padded row's sampled sequence ends at its last generated token, a list's at its own end
    for name in ("padded torch", "padded torch f64"):
        assert sequences[name].equals(sequences["padded numpy"])
    assert sequences["lists torch"].equals(sequences["lists numpy"])
    padded, listed = sequences["padded numpy"], sequences["lists numpy"]
    assert set(padded.column("sample_id").to_pylist()) == set(listed.column("sample_id").to_pylist())
    model = listed.filter(listed.column("is_model_token"))
    assert model.num_rows == padded.filter(padded.column("is_model_token")).num_rows


def test_rounding_and_refusals_follow_the_import(tmp_path):
    arrays = batch(2)
    mon = Monitor(tmp_path / "t", sample_sequences=0, flush_every=100)
    # (0, 1e-3]: bf16 rounding of a near-certain token, read as 0 as an import reads it
    near = {**arrays, "logp_infer": arrays["logp_infer"].copy()}
    i, j = np.argwhere(arrays["mask"])[5]
    near["logp_infer"][i, j] = 4e-4
    zero = {**arrays, "logp_infer": arrays["logp_infer"].copy()}
    zero["logp_infer"][i, j] = 0.0
    assert log(mon, 0, near) == log(mon, 0, zero)
    for value, what in ((np.nan, "logp_infer"), (0.5, "logp_infer"), (-np.inf, "logp_infer"), (np.nan, "logp_train")):
        bad = {**arrays, what: arrays[what].copy()}
        bad[what][i, j] = value
        with pytest.raises(DataError, match=f"{what} of sequence {i} at position {j}"):
            log(mon, 1, bad)
    # the trainer's -inf is a zero probability, counted
    inf = {**arrays, "logp_train": arrays["logp_train"].copy()}
    inf["logp_train"][i, j] = -np.inf
    assert log(mon, 2, inf)["n_zero_prob_train"] == 1
    with pytest.raises(DataError, match="no generated token"):
        log(mon, 3, {**arrays, "mask": np.zeros_like(arrays["mask"])})
    with pytest.raises(DataError, match="shape"):
        log(mon, 3, {**arrays, "logp_train": arrays["logp_train"][:, :-1]})
    with pytest.raises(DataError, match="sequence lengths"):
        lists = as_lists(arrays)
        log(mon, 3, {**lists, "logp_train": [s[:-1] for s in lists["logp_train"]]})


def test_turns_given_or_inferred_and_routing_flips(tmp_path):
    arrays = batch(3)
    m = arrays["mask"]
    starts = m & ~np.pad(m, ((0, 0), (1, 0)))[:, :-1]
    turn = np.where(m, np.cumsum(starts, 1) - 1, -7)
    mon = Monitor(tmp_path / "t", sample_sequences=0, flush_every=100)
    assert log(mon, 0, arrays) == log(mon, 0, arrays, turn=turn)
    one_turn = log(mon, 1, arrays, turn=np.zeros_like(turn))
    assert one_turn["n_model_tokens"] == int(m.sum())
    assert [r["group"] for r in steps_table(tmp_path / "t").to_pylist() if r["step"] == 1] == ["all", "first"]
    rng = np.random.default_rng(0)
    engine = rng.integers(0, 16, (*m.shape, 3, 2))
    trainer = engine.copy()
    (i, j), (k, l) = np.argwhere(m)[[10, 30]]
    engine[i, j - 1, 1], trainer[i, j - 1, 1] = [0, 1], [0, 2]  # the routing behind token (i, j): one layer
    engine[k, l - 1, 2], trainer[k, l - 1, 2] = [3, 4], [4, 3]  # the order within the top-k does not count
    assert log(mon, 2, arrays, experts=(engine, trainer))["routing_flip_share"] == pytest.approx(1 / m.sum())
    same = (torch.from_numpy(engine), torch.from_numpy(engine))
    assert log(mon, 3, arrays, experts=same)["routing_flip_share"] == 0
    first_token = m.copy()
    first_token[0, 0] = True
    with pytest.raises(DataError, match="whole sequences"):
        valid = {k: np.where(first_token, -1.0, v) if k.startswith("logp") else v for k, v in arrays.items()}
        log(mon, 4, {**valid, "mask": first_token}, experts=(engine, engine))


def test_a_rank_other_than_0_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    mon = Monitor(tmp_path / "t")
    assert not mon.active
    assert log(mon, 0, batch(0)) is None and mon.flush() is None and mon.close() is None
    assert not (tmp_path / "t").exists()
    # each rank into a directory of its own
    assert log(Monitor(tmp_path / "rank1", rank_zero_only=False), 0, batch(0))["n_samples"] == 12
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    assert log(Monitor(tmp_path / "t", flush_every=100), 0, batch(0)) is not None


def test_steps_in_any_order_and_from_threads_give_the_same_timeline(tmp_path):
    data = {s: batch(10 + s) for s in range(6)}
    ordered = Monitor(tmp_path / "ordered", flush_every=100)
    for s in range(6):
        log(ordered, s, data[s])
    shuffled = Monitor(tmp_path / "shuffled", flush_every=100)
    for s in (4, 1, 5, 0, 3, 2):
        log(shuffled, s, data[s])
    threaded = Monitor(tmp_path / "threaded", flush_every=100, background=True, queue_size=1)
    workers = [threading.Thread(target=lambda k=k: [log(threaded, s, data[s]) for s in range(k, 6, 2)]) for k in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    threaded.close()  # waits for the queue
    expected = steps_table(tmp_path / "ordered")
    assert expected.column("step").to_pylist()[::3] == [0, 1, 2, 3, 4, 5]
    equal_tables(steps_table(tmp_path / "shuffled"), expected)
    equal_tables(pq.read_table(tmp_path / "threaded" / "steps.parquet"), expected)
    for s in range(6):
        name = f"sequences/step-{s:08d}.parquet"
        assert pq.read_table(tmp_path / "threaded" / name).equals(pq.read_table(tmp_path / "ordered" / name))
    with pytest.raises(ConfigError, match="closed"):
        log(threaded, 9, data[0])


def test_a_worker_error_is_raised_by_the_next_call_and_a_failed_refresh_only_warns(tmp_path, monkeypatch):
    mon = Monitor(tmp_path / "t", background=True, sample_sequences=0)
    bad = {**batch(0), "logp_infer": np.full((12, 40), np.nan, np.float32)}
    log(mon, 0, bad)  # the values are checked in the worker
    with pytest.raises(DataError, match="logp_infer of sequence 0"):
        mon.flush()
    monkeypatch.setattr(runner, "finish", lambda *a, **k: 1 / 0)
    refreshing = Monitor(tmp_path / "r", flush_every=1, sample_sequences=0)
    with pytest.warns(UserWarning, match="refreshing .* failed: division by zero"):
        assert log(refreshing, 0, batch(0))["n_samples"] == 12  # the training goes on
    with pytest.raises(ZeroDivisionError):
        refreshing.close()


def test_a_directory_is_continued_after_a_restart_and_an_import_is_refused(tmp_path):
    data = {s: batch(20 + s) for s in range(4)}
    once = Monitor(tmp_path / "once", flush_every=100)
    for s in range(4):
        log(once, s, data[s])
    crashed = Monitor(tmp_path / "twice", flush_every=100)
    for s in range(3):
        log(crashed, s, data[s])  # then the trainer dies: no close
    # restarted from the checkpoint of step 1: step 2 is logged again, then 3
    with Monitor(tmp_path / "twice", flush_every=100) as resumed:
        log(resumed, 2, data[2])
        log(resumed, 3, data[3])
    record = json.loads((tmp_path / "twice" / "timeline.json").read_text())
    assert record["steps"]["count"] == 4 and record["status"] == "complete"
    equal_tables(pq.read_table(tmp_path / "twice" / "steps.parquet"), steps_table(tmp_path / "once"))
    imported = tmp_path / "imported"
    imported.mkdir()
    (imported / "timeline.json").write_text(json.dumps({**record, "source": {"format": "generic", "path": "x"}}))
    with pytest.raises(ConfigError, match="generic dump, not a monitor's"):
        log(Monitor(imported), 0, data[0])


def test_sampled_sequences_are_bounded_and_hold_the_worst(tmp_path):
    arrays = batch(4, b=64, t=300, two_turns=False)
    worst = 37
    k = np.flatnonzero(arrays["mask"][worst])[20]
    arrays["logp_infer"][worst, k] = np.log(0.9)
    arrays["logp_train"][worst, k] = np.log(0.1)  # |p_train - p_infer| = 0.8
    mon = Monitor(tmp_path / "t", sample_sequences=4, flush_every=100)
    for step in range(3):
        log(mon, step, arrays)
    files = sorted((tmp_path / "t" / "sequences").glob("*.parquet"))
    assert [f.name for f in files] == [f"step-{s:08d}.parquet" for s in range(3)]
    table = pq.read_table(files[0])
    assert table.schema == SEQUENCE_SCHEMA
    seqs = table.group_by(["sample_id", "why"]).aggregate([]).to_pylist()
    assert len(seqs) == 4 and {"sample_id": worst, "why": "worst"} in seqs
    assert sum(s["why"] == "worst" for s in seqs) == 2
    mine = table.filter(table.column("sample_id").to_numpy() == worst)
    assert mine.column("position").to_pylist() == list(range(mine.num_rows))
    assert mine.column("token_id").to_pylist() == arrays["token_ids"][worst, : mine.num_rows].tolist()
    model = mine.column("is_model_token").to_numpy(zero_copy_only=False)
    assert mine.column("logp_infer").null_count == int((~model).sum())
    # the same choice however often a step is logged (the draw is seeded by the step); 4 of 64
    # sequences of ~250 tokens stay small
    log(mon, 0, arrays)
    assert pq.read_table(files[0]).equals(table)
    assert pq.read_table(files[2]).column("sample_id").unique() != table.column("sample_id").unique()
    assert all(f.stat().st_size < 40_000 for f in files)
    log(Monitor(tmp_path / "t", sample_sequences=0, flush_every=100), 1, arrays)
    assert not (tmp_path / "t" / "sequences" / "step-00000001.parquet").exists()


def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a)
    )
    for option in ("tensorboard", "wandb"):
        with pytest.raises(ConfigError) as err:
            Monitor(tmp_path / "t", **{option: True})
        assert f"pip install 'mismatch-probe[{option}]'" in str(err.value) and "\n" not in str(err.value)


def test_tensorboard_gets_the_steps_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = {}
    with Monitor(tmp_path / "t", tensorboard=True, prefix="mm/", sample_sequences=0) as mon:
        for step in (0, 2, 1):
            rows[step] = log(mon, step, batch(step))
    events = EventAccumulator(str(tmp_path / "t" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"mm/k3_kl", "mm/prob_diff_max", "mm/n_model_tokens", "mm/token_tis_clipped_share"} <= tags
    assert "mm/routing_flip_share" not in tags  # null for a dense model: not exported
    for key in ("k3_kl", "mult_prob_error", "n_model_tokens"):
        got = {e.step: e.value for e in events.Scalars(f"mm/{key}")}
        assert got == pytest.approx({s: r[key] for s, r in rows.items()}, rel=1e-6)


def wandb_history(run_dir: str) -> list[dict]:
    """The history rows of an offline W&B run, read from its .wandb file (a LevelDB-style log of
    protobuf records: 32 KiB blocks, a 7-byte header per record piece)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(f"{run_dir}/*.wandb")
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            break  # a record still being written
        piece, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (2, 3):  # first, middle
            pending += piece
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + piece)
        pending = b""
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_gets_the_steps_metrics(tmp_path, monkeypatch):
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = {}
    with Monitor(tmp_path / "t", wandb=True, sample_sequences=0) as mon:
        for step in (0, 3, 1):  # a late step is kept: W&B plots against mismatch/step
            rows[step] = log(mon, step, batch(step))
    (run_dir,) = glob.glob(str(tmp_path / "t" / "wandb" / "offline-run-*"))
    # wandb-core writes the run file in its own process and may still be at it when finish() returns
    deadline = time.monotonic() + 60
    while (
        len(history := [h for h in wandb_history(run_dir) if "mismatch/step" in h]) < 3 and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert [h["mismatch/step"] for h in history] == [0, 3, 1]
    for h in history:
        row = rows[h["mismatch/step"]]
        assert h["mismatch/k3_kl"] == pytest.approx(row["k3_kl"]) and h["mismatch/n_samples"] == 12
        assert {k.removeprefix("mismatch/") for k in h if k.startswith("mismatch/")} - {"step"} <= set(EXPORTED)


def test_import_mismatch_probe_stays_light():
    code = "import sys, mismatch_probe; mismatch_probe.Monitor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_verl_and_trl_examples_log_their_frameworks_batches(tmp_path):
    arrays = batch(5)
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    expected = log(Monitor(tmp_path / "direct", flush_every=100), 2, arrays)
    verl = example("monitor_verl_style")
    data = verl.DataProtoLike(
        {
            "responses": tensors["token_ids"],
            "response_mask": tensors["mask"].long(),
            "rollout_log_probs": tensors["logp_infer"],
            "old_log_probs": tensors["logp_train"],
        }
    )
    assert verl.log_verl_batch(Monitor(tmp_path / "verl", flush_every=100), data, 2) == expected

    trl = example("monitor_trl_callback")
    tool = torch.ones_like(tensors["mask"], dtype=torch.long)
    tool[0, 20:22] = 0  # a tool's output inside the completion: not the policy's tokens
    output = {
        "completion_ids": tensors["token_ids"],
        "completion_mask": tensors["mask"].long(),
        "tool_mask": tool,
        "sampling_per_token_logps": tensors["logp_infer"],
        "old_per_token_logps": tensors["logp_train"],
    }

    class StandIn:  # what the callback touches of a GRPOTrainer
        model = SimpleNamespace(training=True)
        callbacks: list = []

        def add_callback(self, callback):
            self.callbacks.append(callback)

        def _generate_and_score_completions(self, inputs):
            return output

    trainer = StandIn()
    callback = trl.MismatchMonitorCallback(Monitor(tmp_path / "trl", flush_every=100)).attach(trainer)
    assert trainer.callbacks == [callback]
    trainer._generate_and_score_completions({})
    trainer.model.training = False
    trainer._generate_and_score_completions({})  # an evaluation's batch is not a training step's
    callback.on_step_end(None, SimpleNamespace(global_step=2), None)
    masked = {**arrays, "mask": arrays["mask"] & (tool.numpy() == 1)}
    assert steps_table(tmp_path / "trl").to_pylist()[0] == log(Monitor(tmp_path / "d2", flush_every=100), 2, masked)
    assert callback.pending == [] and masked["mask"].sum() < arrays["mask"].sum()
