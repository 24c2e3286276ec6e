"""The steps a dump holds (``list_steps``), listed from names alone, and what each reader then
opens; the checks a step passes before it is compared (a generated token somewhere, NeMo-RL's
lengths covering them); prime-rl's two files of a step; and JSON Lines as Python writes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dumps"))

from training_run import Sequence, Step, write_generic, write_nemo_rl, write_prime_rl

from mismatch_probe.dumps import get_format, list_steps, open_dump
from mismatch_probe.dumps.samples import DumpSample, check_step_has_model_tokens, to_rollout
from mismatch_probe.errors import ConfigError


def synthetic_step(n: int = 6, *, seed: int = 0, temperature: float = 1.0, experts: bool = False) -> Step:
    """``n`` sequences of 8 prompt tokens and a response (a tool's 4 tokens in every other one)."""
    rng = np.random.default_rng(seed)
    sequences = []
    for k in range(n):
        length = int(rng.integers(20, 60))
        mask = np.r_[np.zeros(8, bool), np.ones(length - 8, bool)]
        if k % 2:
            mask[14:18] = False
        engine = -rng.exponential(0.7, length).astype(np.float32)
        trainer = (engine - rng.exponential(0.01, length)).astype(np.float32)
        engine[~mask], trainer[~mask] = np.nan, np.nan
        routed = rng.integers(0, 8, (length - 1, 3, 2)).astype(np.int32) if experts else None
        ids = rng.integers(0, 1000, length)
        sequences.append(Sequence(f"p-{k // 2}", 8, ids, mask, engine, trainer, experts=routed))
    return Step(sequences, temperature=temperature)


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def opened(fmt: str, path: Path, step: int | None) -> tuple[int | None, list[Path]]:
    reader = open_dump(get_format(fmt), path, step=step, trust_pickle=True)
    return reader.step, reader.files


# ---- listing, and opening what was listed --------------------------------------------------------


def layout(fmt: str, root: Path) -> dict[int, list[Path]]:
    """A dump of several steps in ``fmt``'s layout, and the files each step's import reads.
    Readers open nothing until asked for samples (prime-rl reads its rollouts' temperature), so
    slime's, NeMo-RL's and verl's files may be empty here."""
    if fmt == "slime":  # --dump-details: train data for step 3 only; evaluation rollouts are not steps
        r = [touch(root / "rollout_data" / f"{n}.pt") for n in (3, 5)]
        t = touch(root / "train_data" / "3.pt")
        touch(root / "rollout_data" / "eval_3.pt")
        return {3: [r[0], t], 5: [r[1]]}
    if fmt == "nemo-rl":
        return {n: [touch(root / f"train_data_step{n}.jsonl")] for n in (1, 2, 10)}
    if fmt == "verl":  # 0.9: {experiment}_{project}/GBS{b}_N{n}_in{P}_out{R}/{step}/gen_batch.dp
        return {n: [touch(root / "exp_proj" / "GBS4_N2_in16_out32" / str(n) / "gen_batch.dp")] for n in (2, 4)}
    if fmt == "generic":  # step_<N> files (a rank each), and a step_<N>/ directory
        step = synthetic_step()
        files = {
            1: [write_generic(step, root / "step_1.jsonl")],
            2: [write_generic(step, root / f"step_000002.rank{r}.jsonl") for r in (0, 1)],
            30: [write_generic(step, root / "step_30" / name) for name in ("a.jsonl", "b.parquet")],
        }
        touch(root / "step_31" / "notes.txt")  # no data file: no step yet
        return files
    if fmt == "prime-rl":  # a run that exports tokens and ships rollouts through the filesystem
        for n in (0, 1, 7):
            write_prime_rl(synthetic_step(seed=n), root, n)
        d = root / "token_exports" / "step_{}"
        b = root / "rollouts" / "step_{}"
        return {
            n: [Path(str(d).format(n)) / f"rank_{r}.jsonl" for r in (0, 1)]
            + [Path(str(b).format(n)) / f"rank_{r}.bin" for r in (0, 1)]
            for n in (0, 1, 7)
        }
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["slime", "nemo-rl", "verl", "generic", "prime-rl"])
def test_every_format_lists_its_steps_and_opens_exactly_their_files(fmt, tmp_path):
    want = layout(fmt, tmp_path / "dump")
    steps = list_steps(get_format(fmt), tmp_path / "dump")
    assert steps == want and list(steps) == sorted(want)
    for n, files in steps.items():
        assert opened(fmt, tmp_path / "dump", n) == (n, files)
    with pytest.raises(ConfigError, match=r"of \d steps .*pass --step N"):
        opened(fmt, tmp_path / "dump", None)
    with pytest.raises(ConfigError, match="of step 99"):
        opened(fmt, tmp_path / "dump", 99)


def test_a_dump_without_step_numbers_is_step_0(tmp_path):
    step = synthetic_step()
    flat = tmp_path / "flat"
    files = [write_generic(step, flat / f"rl_dump.rank{r}.jsonl") for r in (0, 1)]  # ranks are not steps
    single = write_generic(step, tmp_path / "dump.parquet")
    verl_07 = touch(tmp_path / "cache" / "exp_proj_GBS4__N2")  # verl 0.7: one file, one step
    cases = [("generic", flat, files), ("generic", single, [single]), ("verl", tmp_path / "cache", [verl_07])]
    cases.append(("verl", verl_07, [verl_07]))
    for fmt, path, want in cases:
        assert list_steps(get_format(fmt), path) == {0: want}, path
        assert opened(fmt, path, None) == (None, want)  # no step number: none recorded
        assert opened(fmt, path, 0) == (0, want)
    named = write_generic(step, tmp_path / "runs" / "step_12" / "dump.jsonl")
    assert list_steps(get_format("generic"), named.parent) == {12: [named]}
    assert list_steps(get_format("generic"), named) == {12: [named]}
    nemo = touch(tmp_path / "logs" / "train_data_step4.jsonl")
    assert list_steps(get_format("nemo-rl"), nemo) == {4: [nemo]}
    with pytest.raises(ConfigError, match=r"has no NeMo-RL training-data logs .* of step 5 \(its steps: 4\)"):
        opened("nemo-rl", nemo, 5)


def test_what_no_step_can_be_read_from_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty holds no step of a nemo-rl dump .* \(give a train_data_step"):
        list_steps(get_format("nemo-rl"), tmp_path / "empty")
    with pytest.raises(ConfigError, match="does not exist"):
        list_steps(get_format("slime"), tmp_path / "nope")
    mixed = tmp_path / "mixed"
    write_generic(synthetic_step(), mixed / "step_1.jsonl")
    write_generic(synthetic_step(), mixed / "extra.jsonl")
    with pytest.raises(ConfigError, match=r"holds per-step files \(step_<N>\) and extra.jsonl, which names no step"):
        list_steps(get_format("generic"), mixed)
    for run in ("a", "b"):  # two experiments' logs under one directory: step 1 of two runs
        touch(tmp_path / "logs" / run / "train_data_step1.jsonl")
    with pytest.raises(ConfigError, match=r"holds step 1 of 2 runs"):
        list_steps(get_format("nemo-rl"), tmp_path / "logs")


def test_prime_rl_lists_a_step_once_the_trainer_has_marked_it_stable(tmp_path):
    for n in (3, 4):
        write_prime_rl(synthetic_step(seed=n), tmp_path / "out", n)
    (tmp_path / "out" / "token_exports" / "step_4" / "STABLE").unlink()  # the trainer is writing step 4
    fmt = get_format("prime-rl")
    assert list(list_steps(fmt, tmp_path / "out")) == [3]
    assert list(list_steps(fmt, tmp_path / "out" / "token_exports")) == [3]
    assert list(list_steps(fmt, tmp_path / "out" / "rollouts" / "step_3")) == [3]
    with pytest.raises(ConfigError, match=r"of step 4 \(token_exports/step_4 has no STABLE yet"):
        opened("prime-rl", tmp_path / "out", 4)
    with pytest.raises(ConfigError, match="one rank's file of a step"):
        list_steps(fmt, tmp_path / "out" / "rollouts" / "step_3" / "rank_0.bin")
    # a run without exports: its rollouts are the steps, the engine's side alone
    write_prime_rl(synthetic_step(), tmp_path / "zmq", 5, export=False)
    (tmp_path / "zmq" / "rollouts" / "step_6").mkdir()  # the orchestrator is writing step 6
    (tmp_path / "zmq" / "rollouts" / "step_6" / "rank_0.bin.tmp").touch()
    assert list(list_steps(fmt, tmp_path / "zmq")) == [5]


# ---- prime-rl's samples ------------------------------------------------------------------------


def read(fmt: str, path: Path, **kw):
    reader = open_dump(get_format(fmt), path, **kw)
    return reader, list(reader.samples())


def test_prime_rl_export_and_rollouts_give_both_sides_the_temperature_and_the_routing(tmp_path):
    step = synthetic_step(7, temperature=0.7, experts=True)
    write_prime_rl(step, tmp_path / "out", 2, ranks=2, seq_len=90, pad_to_multiple_of=16)
    reader, samples = read("prime-rl", tmp_path / "out")
    assert reader.step == 2 and reader.settings == {"sampling.temperature": 0.7} and reader.has_trainer
    assert reader.notes == [] and len(samples) == len(step.sequences)
    by_tokens = {tuple(s.token_ids.tolist()): s for s in step.sequences}
    for got in samples:
        want = by_tokens[tuple(got.token_ids.tolist())]  # padding trimmed, packing undone
        m = want.model_mask
        assert got.model_mask.tolist() == m.tolist() and got.where.startswith("step_2/rank_")
        np.testing.assert_array_equal(got.logp_engine[m], want.logp_engine[m])
        np.testing.assert_array_equal(got.logp_trainer[m], want.logp_trainer[m])
        np.testing.assert_array_equal(got.experts[:-1], want.experts)  # row t: token t's routing
        checked = to_rollout(got, 0, vocab_size=1000, num_experts=8)
        assert np.isnan(checked.logp_trainer[~m]).all()

    engine_only = tmp_path / "engine"
    write_prime_rl(step, engine_only, 2, ranks=2, seq_len=90, export=False)
    reader, alone = read("prime-rl", engine_only)
    assert reader.has_trainer is False and reader.settings == {"sampling.temperature": 0.7}
    assert sorted(tuple(s.token_ids.tolist()) for s in alone) == sorted(by_tokens)
    assert all(s.logp_trainer is None and s.experts is not None for s in alone)
    assert alone[0].where == "step_2/rank_0.bin, micro-batch 0, sequence 0"

    export_only = tmp_path / "zmq"  # the default transport writes no rollouts: no temperature on disk
    write_prime_rl(step, export_only, 2, rollouts=False)
    reader, samples = read("prime-rl", export_only)
    assert reader.settings == {} and "records no temperature" in reader.notes[0]
    assert all(s.experts is None for s in samples) and len(samples) == len(step.sequences)


def test_prime_rl_leaves_out_tokens_trained_as_cross_entropy_alone(tmp_path):
    step = synthetic_step(4)
    write_prime_rl(step, tmp_path / "out", 1, ce_only=1, ranks=1)
    reader, samples = read("prime-rl", tmp_path / "out")
    ce = step.sequences[0]  # a frozen model's tokens (sft_distill): not the policy's samples
    got = {tuple(s.token_ids.tolist()): s for s in samples}
    assert not got[tuple(ce.token_ids.tolist())].model_mask.any()
    assert got[tuple(step.sequences[1].token_ids.tolist())].model_mask.sum() == step.sequences[1].model_mask.sum()
    assert f"{int(ce.model_mask.sum())} loss-mask tokens are trained as cross-entropy alone" in reader.notes[0]


def test_prime_rl_refuses_a_step_of_several_temperatures_and_a_foreign_layout(tmp_path):
    write_prime_rl(synthetic_step(temperature=0.6), tmp_path / "a", 1, ranks=1)
    write_prime_rl(synthetic_step(temperature=1.0), tmp_path / "b", 1, ranks=1)
    rollouts = tmp_path / "a" / "rollouts" / "step_1"
    (tmp_path / "b" / "rollouts" / "step_1" / "rank_0.bin").rename(rollouts / "rank_1.bin")
    (tmp_path / "a" / "token_exports" / "step_1" / "rank_0.jsonl").rename(
        tmp_path / "a" / "token_exports" / "step_1" / "rank_1.jsonl"
    )
    with pytest.raises(ConfigError, match=r"drawn at temperatures 0.6, 1 \(environments of their own\)"):
        read("prime-rl", tmp_path / "a")
    import msgspec

    (rollouts / "rank_1.bin").write_bytes(msgspec.msgpack.encode([[[1, 2], [True, False], [0.0, 0.0]]]))
    with pytest.raises(ConfigError, match=r"rank_1.bin is not a list of prime-rl MicroBatch"):
        read("prime-rl", tmp_path / "a")


# ---- a step must hold something to compare --------------------------------------------------------


def dump_sample(where: str, mask: list[int]) -> DumpSample:
    n = len(mask)
    return DumpSample(where, np.arange(n), np.array(mask, bool), np.full(n, -0.5))


def test_a_step_without_a_generated_token_is_refused_naming_its_first_row():
    rows = [dump_sample(f"step.jsonl, row {k}", [0, 0, 0]) for k in range(3)]
    passed = []
    with pytest.raises(ConfigError, match=r"^step.jsonl, row 0 \(the step's first row\): none of the step's 3 samples"):
        passed.extend(check_step_has_model_tokens(rows))
    assert len(passed) == 3  # streamed through before the verdict
    rows[2] = dump_sample("step.jsonl, row 2", [0, 0, 1])
    assert list(check_step_has_model_tokens(rows)) == rows
    assert list(check_step_has_model_tokens([])) == []


def test_every_reader_refuses_a_step_without_a_generated_token(tmp_path):
    step = synthetic_step()
    for s in step.sequences:
        s.model_mask = np.zeros_like(s.model_mask)
    path = write_generic(step, tmp_path / "step.jsonl")
    with pytest.raises(ConfigError, match=r"step.jsonl, row 0 \(the step's first row\): none of the step's 6"):
        read("generic", path)


def test_nemo_rl_lengths_that_leave_out_the_generated_tokens_are_refused(tmp_path):
    step = synthetic_step()
    path = write_nemo_rl(step, tmp_path / "logs", 4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["input_lengths"] = [8]  # the prompt's length: what was generated lies beyond it
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ConfigError, match=r"^train_data_step4.jsonl:2: token_loss_mask marks position 8 as generated, past the row's"
    ) as refused:
        read("nemo-rl", path)
    assert "input_lengths 8" in str(refused.value) and "the prompt alone" in refused.value.hint


def test_json_lines_as_python_writes_them(tmp_path):
    """NaN and -Infinity (json.dumps writes them) parse; a broken line is named."""
    step = synthetic_step(2)
    path = write_nemo_rl(step, tmp_path / "logs", 4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    first_model = int(np.flatnonzero(step.sequences[0].model_mask)[0])
    rows[0]["prev_logprobs"][0][first_model] = float("-inf")
    rows[0]["advantages"][0][0] = float("nan")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, samples = read("nemo-rl", path)
    assert samples[0].logp_trainer[first_model] == -np.inf and len(samples) == 2
    path.write_text(path.read_text() + '{"token_ids": [[1, 2]\n')
    with pytest.raises(ConfigError, match=r"train_data_step4.jsonl:3: not JSON"):
        read("nemo-rl", path)
