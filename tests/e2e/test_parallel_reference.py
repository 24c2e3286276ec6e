"""The reference forward in training layouts, for real: 2 (and 4) rank processes over gloo on CPU.

Correctness: in float32 Ulysses SP=2 and DTensor TP=2 reproduce the single-process log-probs
within float32 rounding. The phenomenon: in bfloat16 TP=2 is measurably off, because each
row-parallel projection rounds its partial sums to bf16 before the all-reduce; Ulysses SP changes
no reduction of a dense model, so it stays (on CPU, exactly) where SP=1 is.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import DENSE, MOE
from reference_checks import RAW, independent, make_rollouts

from mismatch_probe.config.spec import ProbeSpec, ReferenceSpec
from mismatch_probe.config.spec_reading import apply_overrides
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.files import resolve_from_dir
from mismatch_probe.reference import open_reference_scorer
from mismatch_probe.reference.distributed import ReferenceRankError
from mismatch_probe.reference.scorer import ReferenceScorer

pytestmark = pytest.mark.distributed
ROLLOUTS = make_rollouts(12, seed=3)
# small enough that the 12 rollouts take several packed micro-batches, each cut over the ranks
BUDGET = 160


def _layout_spec(dtype, sp, tp, **kw) -> ReferenceSpec:
    return ReferenceSpec(
        dtype=dtype, sequence_parallel_size=sp, tensor_parallel_size=tp, max_tokens_per_micro_batch=BUDGET, **kw
    )


@functools.cache
def scored(model, dtype: str, sp: int, tp: int):
    """Model-token log-probs of ROLLOUTS (concatenated) and the scorer's info, in one layout."""
    scorer = open_reference_scorer(model, _layout_spec(dtype, sp, tp))
    try:
        scores = scorer.score(ROLLOUTS, RAW)
        info = scorer.info()
    finally:
        scorer.close()
    for r, lp in zip(ROLLOUTS, scores.logp):  # same per-token shape whatever the layout
        assert lp.shape == r.token_ids.shape and np.isnan(lp[~r.is_model_token]).all()
    return np.concatenate([lp[r.is_model_token] for r, lp in zip(ROLLOUTS, scores.logp)]).astype(np.float64), info


def _gap(model, dtype, layout) -> np.ndarray:
    return np.abs(scored(model, dtype, *layout)[0] - scored(model, dtype, 1, 1)[0])


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["sp2", "tp2"])
def test_fp32_layouts_reproduce_one_process(model, layout):
    gap = _gap(model, "float32", layout)
    print(f"fp32 {layout}: max |dlogp| {gap.max():.3g}, mean {gap.mean():.3g} over {len(gap)} tokens")
    assert gap.max() < 2e-5  # float32 rounding: the same bound as the single-process forward's own test
    # and the single-process forward is itself right (float64 log-softmax over the model's own forward)
    want = np.concatenate(independent(model, ROLLOUTS)[0])
    assert np.abs(scored(model, "float32", 1, 1)[0] - want).max() < 2e-5


def test_bf16_tensor_parallel_differs_measurably_and_ulysses_does_not():
    tp, sp = _gap(DENSE, "bfloat16", (1, 2)), _gap(DENSE, "bfloat16", (2, 1))
    print(
        f"bf16 tp2: max |dlogp| {tp.max():.3g}, mean {tp.mean():.3g}; "
        f"sp2: max {sp.max():.3g}, mean {sp.mean():.3g} ({len(tp)} tokens)"
    )
    assert tp.mean() > 1e-3 and tp.max() > 1e-2  # the layout moves bf16 log-probs
    assert tp.max() < 1.0  # ... without breaking the model
    assert sp.max() <= tp.max() / 10  # Ulysses splits no reduction of a dense model


def test_info_describes_the_layout():
    sp_info, tp_info = scored(DENSE, "float32", 2, 1)[1], scored(DENSE, "float32", 1, 2)[1]
    assert (sp_info["sequence_parallel_size"], sp_info["tensor_parallel_size"]) == (2, 1)
    assert sp_info["parallel"]["world_size"] == 2 and sp_info["parallel"]["backend"] == "gloo"
    assert sp_info["parallel"]["ulysses"] == {
        "inner_attention": "mismatch_probe_varlen_sdpa",
        "attention_heads_per_rank": 2,
        "kv_head_repeats": 1,
    }
    plan = tp_info["parallel"]["tensor_parallel"]
    # 4 layers: q, k, v, gate, up column-wise; o, down row-wise
    assert plan["sharded_linear_layers"] == {"colwise": 20, "rowwise": 8}
    assert scored(DENSE, "float32", 1, 1)[1]["sequence_parallel_size"] == 1
    # TP shards weights, so each rank built the model on meta and read only its slices;
    # SP replicates them, so each rank loads the whole model
    loading = tp_info["loading"]
    assert loading["method"] == "meta device + per-rank safetensors slices"
    assert 0 < loading["bytes_read"] < loading["bytes_total"]
    assert sp_info["loading"] == {"method": "from_pretrained", "why_not_sharded": "every rank holds the whole model"}


def test_moe_experts_stay_replicated_under_tensor_parallel():
    plan = scored(MOE, "float32", 1, 2)[1]["parallel"]["tensor_parallel"]
    assert plan["sharded_linear_layers"] == {"colwise": 12, "rowwise": 4}  # attention only
    assert any("experts" in r for r in plan["replicated"])
    # transformers fuses the checkpoint's per-expert tensors at load time: no one-to-one slices
    loading = scored(MOE, "float32", 1, 2)[1]["loading"]
    assert loading["method"] == "from_pretrained" and "experts" in loading["why_not_sharded"]


def test_two_dimensional_layout_repeats_kv_heads():
    # sp 2 x tp 2: each tp rank has 1 key/value head, which Ulysses repeats to split it over 2 sp ranks
    logp, info = scored(DENSE, "float32", 2, 2)
    assert info["parallel"]["mesh"] == {"dp": 1, "sp": 2, "tp": 2}
    assert info["parallel"]["ulysses"]["kv_head_repeats"] == 2
    # float32 sums in another order: 1e-6-level, and larger where the CPU's kernels reduce in wider
    # vectors (2.9e-6 measured with AVX-512/AMX, under 2e-6 without)
    assert np.abs(logp - scored(DENSE, "float32", 1, 2)[0]).max() < 5e-6
    assert np.abs(logp - scored(DENSE, "float32", 1, 1)[0]).max() < 2e-5


def test_ulysses_gathers_moe_routing_in_sequence_order():
    rollouts = make_rollouts(6, seed=5)
    for r in rollouts:  # the engine's routing, recorded: the reference then records its own
        r.experts_infer = np.zeros((int(r.is_model_token.sum()), 4, 2), np.int16)
    single = ReferenceScorer(MOE, _layout_spec("float32", 1, 1)).score(rollouts, RAW).experts
    sp = open_reference_scorer(MOE, _layout_spec("float32", 2, 1))
    try:
        gathered = sp.score(rollouts, RAW).experts
    finally:
        sp.close()
    rows = np.concatenate(single)
    assert rows.shape[1:] == (4, 2) and len(np.unique(rows)) > 4  # real routing, not a constant
    same = np.mean(np.all(np.concatenate(gathered) == rows, axis=(1, 2)))
    assert same >= 0.99  # fp32 rounding may flip a near-tie, nothing more


def test_heads_that_do_not_split_fail_before_any_rank_starts():
    with pytest.raises(ConfigError, match="4 attention heads and 2 key/value heads"):
        open_reference_scorer(DENSE, _layout_spec("float32", 1, 3))
    with pytest.raises(ConfigError, match="--train-sp 8"):
        open_reference_scorer(DENSE, _layout_spec("float32", 8, 1))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"packing": False}, "packed row"),
        ({"attn_implementation": "flex_attention"}, "cannot run under sequence parallelism"),
        ({"sequence_parallel_size": 0}, "must be >= 1"),
    ],
)
def test_spec_rejects_layouts_that_cannot_run(change, message):
    spec = ProbeSpec(model=str(DENSE), prompts="p.jsonl")
    with pytest.raises(ConfigError, match=message):
        apply_overrides(spec, {f"reference.{k}": v for k, v in {"sequence_parallel_size": 2, **change}.items()})


def test_an_error_on_a_rank_reaches_the_caller_and_stops_the_ranks():
    bad = make_rollouts(2, seed=6)
    bad[1].is_model_token[0] = True
    scorer = open_reference_scorer(DENSE, _layout_spec("float32", 2, 1))
    procs = list(scorer._procs.processes)
    with pytest.raises(DataError, match="first token is marked as a model token"):
        scorer.score(bad, RAW)
    assert not any(p.is_alive() for p in procs)
    scorer.close()  # idempotent after a failure


def test_compare_with_variants_scores_one_set_of_rollouts_in_each_layout(tmp_path):
    import json

    from conftest import SINGLE_TURN, cli, token_rows

    spec = tmp_path / "layouts.toml"
    spec.write_text(f"""
name = "layouts"
model = "{DENSE}"
prompts = "{SINGLE_TURN}"
out = "{tmp_path / "runs"}"
max_prompts = 6
[engine]
name = "hf"
dtype = "bfloat16"
[sampling]
max_tokens = 24
n = 2
[reference]
dtype = "float32"
[[variants]]
name = "one"
[[variants]]
name = "sp2"
reference.sequence_parallel_size = 2
[[variants]]
name = "tp2"
reference.tensor_parallel_size = 2
""")
    proc = cli("compare", str(spec))
    assert proc.returncode == 0, proc.stderr
    assert "variants: the same rollouts" in proc.stdout and "compare.html" in proc.stdout
    runs = tmp_path / "runs"
    html = (runs / "compare.html").read_text()
    assert "All runs score the same rollouts" in html and "HF fp32 sdpa padding-free SP2" in html

    one = token_rows(runs / "one", model_only=True)
    assert one.num_rows > 50
    for name, (sp, tp) in (("sp2", (2, 1)), ("tp2", (1, 2))):
        other = token_rows(runs / name, model_only=True)
        assert other.column("token_id").equals(one.column("token_id"))
        assert other.column("logp_infer").equals(one.column("logp_infer"))
        gap = np.abs(other.column("logp_train").to_numpy() - one.column("logp_train").to_numpy())
        assert gap.max() < 2e-5
        rec = json.loads((runs / name / "run.json").read_text())
        assert rec["reference"]["parallel"]["mesh"] == {"dp": 1, "sp": sp, "tp": tp}
        peaks = rec["reference"]["parallel"]["peak_memory_per_rank"]  # each spawned rank's own
        assert len(peaks) == 2 and all(p["rss_bytes"] > 2**20 for p in peaks)
        assert rec["rollouts_from"]["run"] == "../one"  # relative to the run directory: the pair moves together
        assert (runs / name / "reference.log").is_file()


def test_a_bad_layout_fails_before_the_engine_samples(tmp_path):
    from conftest import SINGLE_TURN, cli

    proc = cli(
        "compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(tmp_path / "r"), "--train-tp", "3"
    )
    assert proc.returncode == 2
    assert "--train-tp 3: the model has 4 attention heads and 2 key/value heads" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_a_rank_that_dies_is_reported_not_waited_for():
    import os
    import signal

    scorer = open_reference_scorer(DENSE, _layout_spec("float32", 1, 2))
    victim = scorer._procs.processes[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    procs = list(scorer._procs.processes)
    with pytest.raises(ReferenceRankError, match="rank 1 was killed by SIGKILL"):
        scorer.score(ROLLOUTS[:2], RAW)
    assert not any(p.is_alive() for p in procs)
    scorer.close()


def test_cli_train_sp_rescores_another_runs_rollouts(bf16_run, tmp_path):
    """--train-sp and --rollouts-from from the command line: the session's hf run, re-scored by an
    fp32 reference over 2 Ulysses ranks, gives its log-probs back within float32 rounding."""
    import json

    from conftest import SINGLE_TURN, cli, token_rows

    out = tmp_path / "sp2"
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(out),
        "--engine-dtype",
        "bfloat16",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "48",
        "--n",
        "2",
        "--max-prompts",
        "16",
        "--seed",
        "7",
        "--train-sp",
        "2",
        "--rollouts-from",
        str(bf16_run),
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((out / "run.json").read_text())
    assert rec["reference"]["sequence_parallel_size"] == 2
    assert resolve_from_dir(out, rec["rollouts_from"]["run"]) == bf16_run.resolve()
    assert "engine_start_s" not in rec["timings"]

    def logp_train(run):
        return token_rows(run, model_only=True).column("logp_train").to_numpy()

    assert np.abs(logp_train(out) - logp_train(bf16_run)).max() < 2e-5
    mismatched = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "x"),
        "--rollouts-from",
        str(bf16_run),
        "--max-tokens",
        "32",
    )
    assert mismatched.returncode == 2 and "another model, prompt set, engine or sampling" in mismatched.stderr
