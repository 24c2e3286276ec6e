"""The reference's LM head runs a bounded number of positions at a time (reference/scorer.py:
lm_head_chunk): at most 128 MiB of float32 logits a chunk, so a 151,936-token vocabulary does not
hold gigabytes at the head; the log-probs depend on the chunk only by float32 rounding (the GEMM's
blocking follows its row count)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference import scorer
from mismatch_probe.table.tokens import Rollout

DENSE = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "tiny-qwen2"


def test_the_chunk_holds_at_most_128_mib_of_logits():
    assert scorer.lm_head_chunk(1024) == 2048  # the fixture: the cap on positions
    assert scorer.lm_head_chunk(151936) == 220  # Qwen's vocabulary: 220 x 151,936 x 4 B <= 128 MiB
    assert scorer.lm_head_chunk(151936) * 151936 * 4 <= 128 << 20 < (scorer.lm_head_chunk(151936) + 1) * 151936 * 4
    assert scorer.lm_head_chunk(10**9) == 1  # never zero


def test_the_log_probs_do_not_depend_on_the_chunk(monkeypatch):
    rng = np.random.default_rng(0)
    rollouts = []
    for i, n in enumerate((40, 75, 9)):
        ids = rng.integers(3, 1000, n).astype(np.int32)
        model = np.r_[np.zeros(5, bool), np.ones(n - 5, bool)]
        rollouts.append(Rollout(i, "", ids, np.zeros(n, np.int16), model, np.zeros(n, np.float32), ""))
    ref = scorer.ReferenceScorer(DENSE, ReferenceSpec(dtype="float32", logits_fp32=True, device="cpu"))
    raw = LogprobSemantics("raw")
    whole = ref.score(rollouts, raw)
    monkeypatch.setattr(scorer, "LM_HEAD_CHUNK_BYTES", 7 * 1024 * 4)  # 7 positions a chunk at the fixture's vocabulary
    assert scorer.lm_head_chunk(1024) == 7
    chunked = ref.score(rollouts, raw)
    for a, b in zip(whole.logp, chunked.logp, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # a few float32 ulps
    for a, b in zip(whole.entropy, chunked.entropy, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
