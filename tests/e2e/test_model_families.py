"""Architectures beyond the fixture's, through the CLI, from tiny random checkpoints built at test
time (tests/tiny_models.py; every family's conformance is in tests/families/).

gpt-oss: attention sinks have no SDPA kernel in transformers, so ``auto`` attention falls back to
eager on both sides (recorded, shown in the report); its model builds attention masks without the
position ids, so packed rows need masks built for it (checked at load, recorded). gemma2: soft-capped
attention scores, which transformers' sdpa drops, so ``auto`` is eager there too; its logits are
soft-capped after the LM head. Both show their quirks in the report's environment card.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SINGLE_TURN, cli
from reference_checks import RAW, independent, make_rollouts

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.reference.scorer import ReferenceScorer


@pytest.fixture(scope="session")
def gpt_oss(zoo):
    return zoo["gpt_oss"]


@pytest.fixture(scope="session")
def gpt_oss_run(gpt_oss, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "gpt-oss-fp32"
    proc = cli(
        "compare",
        "--model",
        str(gpt_oss),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(out),
        "--engine",
        "hf",
        "--engine-dtype",
        "float32",
        "--train-dtype",
        "float32",
        "--max-prompts",
        "8",
        "--n",
        "2",
        "--max-tokens",
        "40",
        "--seed",
        "3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_gpt_oss_scored_by_hf_engine_and_reference_in_fp32(gpt_oss_run):
    rec = json.loads((gpt_oss_run / "run.json").read_text())
    for side in ("engine", "reference"):
        assert rec[side]["attn_implementation"] == "eager", side
        assert rec[side]["attn_implementation_requested"] == "auto"
        assert "GptOssForCausalLM does not support sdpa" in rec[side]["attn_fallback"]
    assert rec["reference"]["packed_attention_mask"].startswith("built from the position ids by mismatch-probe")
    m = rec["metrics"]
    # prompts of ~20 tokens plus up to 40 sampled: sequences cross the 16-token sliding window
    assert m["n_model_tokens"] > 100 and m["k3_kl"] < 1e-9 and m["prob_diff_max"] < 1e-4
    assert rec["decode_vs_prefill"]["k3_kl"] < 1e-9
    assert rec["routing"]["set_agreement_mean"] == 1.0 and rec["routing"]["top_k"] == 2  # MoE, fp32 both sides
    assert rec["architecture"]["attention_sinks"] is True and rec["architecture"]["moe"]["top_k"] == 2
    html = (gpt_oss_run / "report.html").read_text()
    assert "attn_fallback=GptOssForCausalLM does not support sdpa" in html  # the environment card
    assert "attention sinks, a learned logit per head" in html and "model quirks" in html


def test_gpt_oss_packed_rows_equal_padded_micro_batches(gpt_oss):
    """Sequences packed into one row must not see each other: the masks built from the position
    ids keep them apart, so packing changes nothing against padded micro-batches, and both equal
    the model's own forward one sequence at a time."""
    rollouts = make_rollouts(6, seed=4)  # 4 to 49 tokens: across the 16-token sliding window
    scores = {}
    for packing in (True, False):
        spec = ReferenceSpec(dtype="float32", logits_fp32=True, packing=packing, micro_batch_size=6, device="cpu")
        scorer = ReferenceScorer(gpt_oss, spec)
        assert scorer.info()["attn_implementation"] == "eager"
        lp = scorer.score(rollouts, RAW).logp
        scores[packing] = np.concatenate([x[r.is_model_token] for x, r in zip(lp, rollouts)])
        scorer.close()
    # equal to float32 rounding (a few ulp of log-probs around -8); a neighbour's leak is O(1)
    np.testing.assert_allclose(scores[True], scores[False], rtol=1e-6, atol=1e-6)
    want, _ = independent(gpt_oss, rollouts)
    np.testing.assert_allclose(scores[True], np.concatenate(want), rtol=1e-5, atol=1e-5)


def test_an_attention_the_architecture_lacks_is_refused_before_loading(gpt_oss, tmp_path):
    proc = cli(
        "compare",
        "--model",
        str(gpt_oss),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "r"),
        "--engine",
        "hf",
        "--train-attn",
        "sdpa",
        "--max-prompts",
        "1",
        "--max-tokens",
        "4",
    )
    assert proc.returncode == 2, proc.stderr
    assert "GptOssForCausalLM does not support attn_implementation='sdpa'" in proc.stderr
    assert "'auto'" in proc.stderr and "Traceback" not in proc.stderr


def test_gemma2_soft_caps_run_eager_and_show_in_the_report(zoo, tmp_path):
    out = tmp_path / "gemma2"
    args = ["--model", str(zoo["gemma2"]), "--prompts", str(SINGLE_TURN), "--engine", "hf", "--max-prompts", "2"]
    proc = cli(
        "compare",
        *args,
        "--out",
        str(out),
        "--engine-dtype",
        "float32",
        "--train-dtype",
        "float32",
        "--n",
        "2",
        "--max-tokens",
        "24",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "run.json").read_text())
    for side in ("engine", "reference"):
        assert rec[side]["attn_implementation"] == "eager"
        assert "soft-caps attention scores (attn_logit_softcapping=2)" in rec[side]["attn_fallback"]
    arch = rec["architecture"]
    assert arch["final_logit_softcapping"] == 3.0 and arch["attn_logit_softcapping"] == 2.0
    assert arch["tied_embeddings"] is True and arch["sliding_window"] == {"size": 16, "layers": [0], "of_layers": 2}
    assert rec["metrics"]["k3_kl"] < 1e-9
    for name in ("report.html", "report.md"):
        text = (out / name).read_text()
        assert "logits soft-capped at 3" in text and "sliding-window attention (16 tokens) on 1 of 2 layers (0)" in text
    refused = cli("compare", *args, "--out", str(tmp_path / "sdpa"), "--train-attn", "sdpa", "--max-tokens", "4")
    assert refused.returncode == 2 and "ignores the cap" in refused.stderr and "Traceback" not in refused.stderr
