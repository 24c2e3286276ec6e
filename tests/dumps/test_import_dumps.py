"""``mismatch-probe import``: a training step on the fixture model (real bf16 "engine" and fp32
"trainer" forwards, tool calls between turns), dumped as slime, NeMo-RL, verl, prime-rl and the
generic format write it, imported, analyzed and re-scored. The metrics of what the run saw equal a float64
recomputation from the dumped arrays; the reference's re-score of the same tokens agrees with the
float32 trainer within float32 rounding (often to the last bit), which it can only do if every
log-prob sits on its token."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import DENSE, MOE, SINGLE_TURN, cli
from required import unavailable
from training_run import (
    Step,
    simulate,
    verl_site,
    write_generic,
    write_nemo_rl,
    write_prime_rl,
    write_slime,
    write_verl,
)

from mismatch_probe import pipeline
from mismatch_probe.errors import ConfigError
from mismatch_probe.importing import ImportOptions, import_dump

FP32 = {"reference.dtype": "float32", "reference.logits_fp32": True}


def require_verl() -> None:
    """verl's own DataProto builds the verl dumps; CI installs it (tests/dumps/install-verl.sh)."""
    if verl_site() is None:
        unavailable("VERL", "verl is not installed for the tests: bash tests/dumps/install-verl.sh .verl-site")


@pytest.fixture(scope="module")
def step() -> Step:
    return simulate(DENSE, SINGLE_TURN, n_prompts=4, n=2)


def write(fmt: str, step: Step, d) -> tuple[str, object]:
    """The dump of ``step`` in one of the formats, and what to pass to import."""
    if fmt == "slime":
        write_slime(step, d / "dump")
        return "slime", d / "dump"
    if fmt == "nemo-rl":
        return "nemo-rl", write_nemo_rl(step, d / "logs")
    if fmt == "generic-parquet":
        return "generic", write_generic(step, d / "dump.parquet")
    if fmt == "generic-jsonl":
        return "generic", write_generic(step, d / "dump.jsonl", compact=True)
    if fmt == "verl":  # a batch saved after compute_log_prob: old_log_probs are the trainer's
        return "verl", write_verl(step, d / "rollout_cache", old_log_probs=True)
    if fmt == "prime-rl":  # the run's output_dir: token export (both sides) and filesystem rollouts
        return "prime-rl", write_prime_rl(step, d / "outputs", 3)
    raise AssertionError(fmt)


FORMATS = ["slime", "nemo-rl", "generic-parquet", "generic-jsonl", "verl", "prime-rl"]


def expected(step: Step) -> dict:
    """The engine-vs-trainer metrics, recomputed in float64 from the dumped arrays."""
    li, lt = step.model_arrays()
    d = lt - li
    return {
        "n_model_tokens": len(d),
        "k3_kl": float(np.mean(np.expm1(d) - d)),
        "k1_kl": float(np.mean(-d)),
        "abs_delta_mean": float(np.mean(np.abs(d))),
        "abs_delta_max": float(np.max(np.abs(d))),
        "prob_diff_max": float(np.max(np.abs(np.exp(lt) - np.exp(li)))),
        "log_ppl_infer": float(
            np.mean([-np.mean(s.logp_engine[s.model_mask].astype(np.float64)) for s in step.sequences])
        ),
    }


def later_turn_tokens(step: Step) -> int:
    """Model tokens after a tool call (the second run of model tokens of a sequence)."""
    total = 0
    for s in step.sequences:
        m = s.model_mask
        starts = np.flatnonzero(m & ~np.concatenate([[False], m[:-1]]))
        total += int(m[starts[1] :].sum()) if len(starts) > 1 else 0
    return total


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dump_analyzes_as_what_the_run_saw_and_rescores(fmt, step, tmp_path):
    if fmt == "verl":
        require_verl()
    name, path = write(fmt, step, tmp_path)
    options = ImportOptions(trust_pickle=fmt == "verl")
    ctx = import_dump(name, path, model=DENSE, out=tmp_path / "run", options=options)
    info = ctx.record.imported_from
    assert info["samples"] == len(step.sequences) and info["trainer_logprobs"] is True
    assert info["model_tokens"] == sum(int(s.model_mask.sum()) for s in step.sequences)
    assert ctx.record.reference.to_dict()["source"] == "trainer"

    rec = pipeline.analyze(tmp_path / "run").run  # the engine against the trainer, as the run saw it
    want = expected(step)
    for key, value in want.items():
        assert rec.metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert rec.metrics["k3_kl"] > 1e-6  # bf16 vs fp32: a real mismatch, not zero
    assert rec.metrics_by_turn["later"]["n_model_tokens"] == later_turn_tokens(step) > 0
    assert rec.trainer is None and (tmp_path / "run" / "report.html").is_file()
    html = (tmp_path / "run" / "report.html").read_text()
    assert f"your trainer ({name}, from the dump)" in html and f"(from a {name} dump)" in html
    assert f"engine vs your trainer ({name})" in (tmp_path / "run" / "report.md").read_text()

    # the same tokens against mismatch-probe's float32 reference, the trainer's log-probs beside it
    pipeline.score(tmp_path / "run", out=tmp_path / "ref", overrides=FP32)
    ref = pipeline.analyze(tmp_path / "ref").run
    assert ref.imported_from["format"] == name and ref.reference.dtype == "float32"
    for key in want:
        assert ref.trainer["engine_vs_trainer"][key] == pytest.approx(rec.metrics[key], rel=1e-12, abs=1e-15), key
    # the trainer is a float32 HF forward too: the reference agrees with it on every token, within
    # float32 rounding (packed rows of other lengths sum in another order); one position off would be ~1
    assert ref.trainer["trainer_vs_reference"]["abs_delta_max"] <= 1e-5
    assert ref.trainer["trainer_vs_reference"]["k3_kl"] <= 1e-11
    assert ref.metrics["k3_kl"] == pytest.approx(rec.metrics["k3_kl"], rel=1e-3)
    tokens = pq.read_table(tmp_path / "ref" / "tokens.parquet")
    model = tokens.column("is_model_token").to_numpy(zero_copy_only=False)
    assert not np.isnan(tokens.column("logp_trainer").to_numpy(zero_copy_only=False)[model]).any()
    md = (tmp_path / "ref" / "report.md").read_text()
    assert "your trainer vs reference" in md and "engine vs your trainer" in md


def test_nemo_rl_forced_on_policy_ratio_has_no_trainer_log_probs(step, tmp_path):
    path = write_nemo_rl(step, tmp_path / "logs", forced_on_policy=True)
    ctx = import_dump("nemo-rl", path, model=DENSE, out=tmp_path / "run")
    info = ctx.record.imported_from
    assert info["trainer_logprobs"] is False
    assert any("force_on_policy_ratio" in note for note in info["notes"])
    assert not (tmp_path / "run" / "tokens.parquet").exists() and ctx.record.reference is None
    refused = cli("analyze", str(tmp_path / "run"))
    assert refused.returncode == 2 and "scored token shards" in refused.stderr
    args = ("--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--engine", "hf", "--out", str(tmp_path / "c"))
    refused = cli("compare", *args, "--rollouts-from", str(tmp_path / "run"))
    assert refused.returncode == 2 and "was imported from a nemo-rl dump" in refused.stderr
    assert f"mismatch-probe score {tmp_path / 'run'} --out NEW_DIR" in refused.stderr and not (tmp_path / "c").exists()
    pipeline.score(tmp_path / "run", overrides={})  # the engine side, scored in place by the reference
    rec = pipeline.analyze(tmp_path / "run").run
    assert rec.metrics["n_model_tokens"] == expected(step)["n_model_tokens"] and rec.trainer is None


def test_slime_imports_the_samples_its_train_dump_holds(step, tmp_path):
    import torch

    write_slime(step, tmp_path / "dump")
    train = tmp_path / "dump" / "train_data" / "3.pt"
    dump = torch.load(train, weights_only=True)
    dump["samples"] = dump["samples"][:5]  # slime drops the samples that do not fit its DP schedule
    torch.save(dump, train)
    ctx = import_dump("slime", tmp_path / "dump", model=DENSE, out=tmp_path / "run")
    assert ctx.record.imported_from["samples"] == 5
    assert any("holds 5 of the rollout's 8 samples" in n for n in ctx.record.imported_from["notes"])
    whole = import_dump(
        "slime", tmp_path / "dump", model=DENSE, out=tmp_path / "all", options=ImportOptions(use_trainer=False)
    )
    assert whole.record.imported_from["samples"] == 8 and whole.record.imported_from["trainer_logprobs"] is False


def test_slime_checks_the_tokenizer_it_saved_against_the_checkpoint(step, tmp_path):
    import shutil

    write_slime(step, tmp_path / "dump")
    saved = tmp_path / "dump" / "tokenizer"  # what --dump-details saves beside rollout_data/
    saved.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DENSE / name, saved / name)
    assert (
        import_dump("slime", tmp_path / "dump", model=DENSE, out=tmp_path / "same").record.imported_from["samples"] == 8
    )
    tok = json.loads((saved / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # a tokenizer that reads ids 300 and 301 the other way round
    (saved / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"tokenizer the run saved with its dump .* differ on 2 token\(s\)"):
        import_dump("slime", tmp_path / "dump", model=DENSE, out=tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_an_interrupted_import_resumes_with_the_same_shards(step, tmp_path, monkeypatch):
    from mismatch_probe import importing

    path = write_generic(step, tmp_path / "dump.parquet")
    options = ImportOptions(shard_size=2)
    fresh = import_dump("generic", path, model=DENSE, out=tmp_path / "fresh", options=options)
    real = importing.to_rollout

    def dies_at_sample_5(sample, sample_id, **kw):
        if sample_id == 5:
            raise KeyboardInterrupt
        return real(sample, sample_id, **kw)

    monkeypatch.setattr(importing, "to_rollout", dies_at_sample_5)
    with pytest.raises(KeyboardInterrupt):
        import_dump("generic", path, model=DENSE, out=tmp_path / "run", options=options)
    monkeypatch.setattr(importing, "to_rollout", real)
    run = tmp_path / "run"
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    done = sorted((run / "rollouts").glob("part-*.parquet"))
    assert len(done) == 2  # shards 0 and 1 (samples 0-3) were complete
    mtimes = [os.stat(p).st_mtime_ns for p in done]
    ctx = import_dump("generic", path, model=DENSE, out=run, options=options)
    assert ctx.record.resumed == {"rollout_shards_reused": 2}
    assert [os.stat(p).st_mtime_ns for p in done] == mtimes
    for sub in ("rollouts", "tokens.parquet"):
        names = sorted(p.name for p in (tmp_path / "fresh" / sub).glob("part-*.parquet"))
        assert names == sorted(p.name for p in (run / sub).glob("part-*.parquet")) and len(names) == 4
        for name in names:  # the same bytes as an import that was never interrupted
            assert (run / sub / name).read_bytes() == (tmp_path / "fresh" / sub / name).read_bytes(), name
    assert fresh.record.imported_from["fingerprint"] == ctx.record.imported_from["fingerprint"]
    pipeline.analyze(run)
    metrics = json.loads((run / "run.json").read_text())["metrics"]
    again = import_dump("generic", path, model=DENSE, out=run, options=options)  # finished: kept as it is
    assert again.record.metrics == metrics and again.record.status == "complete"
    with pytest.raises(ConfigError, match="holds another run"):  # other options, same directory
        import_dump("generic", path, model=DENSE, out=run, options=ImportOptions(shard_size=3))


@pytest.fixture(scope="module")
def moe_step() -> Step:
    return simulate(MOE, SINGLE_TURN, n_prompts=2, n=2, record_routing=True)


@pytest.mark.parametrize("fmt", ["slime", "verl", "generic-jsonl", "prime-rl"])
def test_moe_routing_in_a_dump_is_compared_with_the_reference(fmt, moe_step, tmp_path):
    if fmt == "verl":
        require_verl()
    step = moe_step
    if fmt == "slime":
        write_slime(step, tmp_path / "dump")
        name, path = "slime", tmp_path / "dump"
    elif fmt == "verl":  # routed_experts [B, P + R, layers, k], rows from the left padding on
        name, path = "verl", write_verl(step, tmp_path / "dump", old_log_probs=True)
    elif fmt == "prime-rl":  # the rollouts' routing, joined to the token export's lines
        name, path = "prime-rl", write_prime_rl(step, tmp_path / "dump", 1)
    else:
        name, path = "generic", write_generic(step, tmp_path / "dump.jsonl")
    ctx = import_dump(name, path, model=MOE, out=tmp_path / "run", options=ImportOptions(trust_pickle=True))
    assert ctx.record.imported_from["routed_experts"] is True and ctx.record.engine.routing is not None
    pipeline.score(tmp_path / "run", out=tmp_path / "ref", overrides=FP32)
    rec = pipeline.analyze(tmp_path / "ref").run
    # independently: a model token flips when any layer's expert set differs between the bf16
    # forward (the dump's) and the float32 one, for the input before it
    flips = []
    for s in step.sequences:
        rows = np.flatnonzero(s.model_mask) - 1
        a, b = np.sort(s.experts[rows], -1), np.sort(s.experts_trainer[rows], -1)
        flips.append(np.any(a != b, axis=(1, 2)))
    flips = np.concatenate(flips)
    assert rec.routing["tokens_with_flip_share"] == pytest.approx(flips.mean(), abs=1e-12)
    assert rec.routing["num_experts"] == 8


# ---- bad dumps: one line naming the sample, exit 2 -----------------------------------------------


def test_bad_dumps_are_refused_naming_the_sample(step, tmp_path):
    rows = [json.loads(line) for line in write_generic(step, tmp_path / "ok.jsonl").read_text().splitlines()]
    rows[1]["token_ids"][3] = 5000
    (tmp_path / "vocab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli(
        "import", "generic", str(tmp_path / "vocab.jsonl"), "--model", str(DENSE), "--out", str(tmp_path / "a")
    )
    assert result.returncode == 2
    assert "vocab.jsonl, row 1: token id 5000 is outside the checkpoint's vocabulary (0..1023)" in result.stderr
    assert "Traceback" not in result.stderr

    rows[1]["token_ids"][3] = 7
    rows[2]["logp_engine"] = rows[2]["logp_engine"][:-1]
    (tmp_path / "count.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli(
        "import", "generic", str(tmp_path / "count.jsonl"), "--model", str(DENSE), "--out", str(tmp_path / "b")
    )
    assert (
        result.returncode == 2 and "count.jsonl, row 2: " in result.stderr and "engine log-probs for" in result.stderr
    )

    write_nemo_rl(step, tmp_path / "logs", n=4)
    write_nemo_rl(step, tmp_path / "logs", n=5)
    result = cli("import", "nemo-rl", str(tmp_path / "logs"), "--model", str(DENSE), "--out", str(tmp_path / "c"))
    assert result.returncode == 2 and "of 2 steps (4, 5)" in result.stderr and "--step N" in result.stderr
    result = cli(
        "import", "nemo-rl", str(tmp_path / "logs"), "--step", "5", "--model", str(DENSE), "--out", str(tmp_path / "c")
    )
    assert result.returncode == 0, result.stderr
    assert "imported 8 samples" in result.stdout and "step 5" in result.stdout


def test_a_step_without_generated_tokens_is_refused_naming_the_file_and_row(step, tmp_path):
    """NeMo-RL lengths that cover only the prompt, and a step whose masks mark nothing: refused at
    import, not imported for ``analyze`` to ask for a ``score`` that cannot help."""
    path = write_nemo_rl(step, tmp_path / "logs", n=4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, s in zip(rows, step.sequences):
        row["input_lengths"] = [s.prompt_len]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = cli("import", "nemo-rl", str(path), "--model", str(DENSE), "--out", str(tmp_path / "a"))
    first = step.sequences[0].prompt_len
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"train_data_step4.jsonl:1: token_loss_mask marks position {first} as generated, past the row's " in (
        result.stderr
    )
    assert f"input_lengths {first}" in result.stderr

    rows = [json.loads(line) for line in write_generic(step, tmp_path / "ok.jsonl").read_text().splitlines()]
    for row in rows:
        row["model_mask"] = [0] * len(row["model_mask"])
        row["logp_engine"] = [None] * len(row["model_mask"])
        row.pop("logp_trainer")
    (tmp_path / "none.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=r"none.jsonl, row 0 \(the step's first row\): none of the step's 8 samples"):
        import_dump("generic", tmp_path / "none.jsonl", model=DENSE, out=tmp_path / "b")


def test_prime_rl_rollouts_without_a_token_export_score_in_place(tmp_path, step):
    """The filesystem transport without trainer.enable_token_export: the engine's side, with the
    temperature the orchestrator stamped on every token."""
    step.temperature = 0.8
    try:
        root = write_prime_rl(step, tmp_path / "outputs", 5, export=False)
    finally:
        step.temperature = 1.0
    ctx = import_dump("prime-rl", root, model=DENSE, out=tmp_path / "run")
    info = ctx.record.imported_from
    assert info["step"] == 5 and info["trainer_logprobs"] is False and info["samples"] == len(step.sequences)
    assert info["settings_from"]["sampling.temperature"] == "dump" and ctx.record.spec.sampling.temperature == 0.8


def test_verl_rollout_cache_without_trainer_log_probs_scores_in_place(step, tmp_path):
    require_verl()
    root = write_verl(step, tmp_path / "cache")  # what RolloutSkip saves: the rollout, before the actor
    refused = cli("import", "verl", str(root), "--model", str(DENSE), "--out", str(tmp_path / "run"))
    assert refused.returncode == 2 and "--trust-pickle" in refused.stderr and not (tmp_path / "run").exists()
    ctx = import_dump("verl", root, model=DENSE, out=tmp_path / "run", options=ImportOptions(trust_pickle=True))
    assert ctx.record.imported_from["step"] == 2 and ctx.record.imported_from["trainer_logprobs"] is False
    pipeline.score(tmp_path / "run", overrides={})
    rec = pipeline.analyze(tmp_path / "run").run
    li, _ = step.model_arrays()
    assert rec.metrics["n_model_tokens"] == len(li)
    assert rec.metrics["log_ppl_infer"] == pytest.approx(expected(step)["log_ppl_infer"], rel=1e-12)


def test_verl_text_dump_is_refused_with_the_setting_to_use(tmp_path):
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "12.jsonl").write_text(
        json.dumps({"input": "q", "output": "a", "score": 1.0, "step": 12}) + "\n"
    )
    result = cli("import", "verl", str(tmp_path / "rollouts"), "--model", str(DENSE), "--trust-pickle")
    assert result.returncode == 2
    assert "trainer.rollout_data_dir" in result.stderr and "skip.rollout.enable=True" in result.stderr
    assert "calculate_log_probs=True" in result.stderr


def test_verl_numpy_serialization_and_old_slime_numpy_experts_read_the_same(moe_step, tmp_path):
    """verl with VERL_DATAPROTO_SERIALIZATION_METHOD=numpy pickles its batch as NumPy bytes;
    slime before 2026-06 stored routed experts as a NumPy array (torch.load then needs NumPy's
    array reconstruction allowed, and nothing else)."""
    import torch

    require_verl()
    ours = import_dump("slime", write_slime(moe_step, tmp_path / "slime").parent.parent, model=MOE, out=tmp_path / "a")
    root = write_verl(moe_step, tmp_path / "verl", old_log_probs=True, numpy_serialization=True)
    verl = import_dump("verl", root, model=MOE, out=tmp_path / "b", options=ImportOptions(trust_pickle=True))
    dump = torch.load(tmp_path / "slime" / "rollout_data" / "3.pt", weights_only=True)
    for s in dump["samples"]:
        s["rollout_routed_experts"] = np.frombuffer(s["rollout_routed_experts"].numpy().tobytes(), np.int32).reshape(
            s["rollout_routed_experts"].shape
        )
    torch.save(dump, tmp_path / "slime" / "rollout_data" / "3.pt")
    old = import_dump("slime", tmp_path / "slime", model=MOE, out=tmp_path / "c")
    for run in (verl, old):
        for sub in ("rollouts", "tokens.parquet"):
            a = pq.read_table(ours.out / sub).drop_columns(["prompt_id"])
            b = pq.read_table(run.out / sub).drop_columns(["prompt_id"])
            for name in a.column_names:  # finish_reason: slime's status, verl's unknown
                if name != "finish_reason":
                    assert a.column(name).to_pylist() == b.column(name).to_pylist() or _nan_equal(a, b, name), (
                        sub,
                        name,
                    )


def _nan_equal(a, b, name) -> bool:
    x = a.column(name).to_pylist()
    y = b.column(name).to_pylist()
    return json.dumps(x).replace("NaN", "null") == json.dumps(y).replace("NaN", "null")
