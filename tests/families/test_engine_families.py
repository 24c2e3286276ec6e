"""Model-family conformance of the real engines' CPU builds: every family of tests/tiny_models.py
loaded, sampled and scored by prefill in vLLM and in SGLang (one child per engine for all families,
tests/families/engine_families.py), in float32, against the reference in float32.

A family an engine refuses (or dies on) is an xfail with the engine's own reason, as the
committed supported-models table lists it; one it runs with log-probs that are not the model's
(the reference, itself checked against a float64 eager forward in test_reference_families.py,
disagrees far beyond float32 rounding) is recorded as "differs". Either way, an engine upgrade
that fixes it fails the test until the table is regenerated (scripts/supported_models.py).
"""

from __future__ import annotations

import sys

import model_support
import numpy as np
import pytest
from conftest import SGLANG_PYTHON
from engine_families import run_families
from model_support import Differs, Refused
from tiny_models import FAMILIES

from mismatch_probe.analysis.terms import token_terms
from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.table.tokens import Rollout

# fp32 engine vs fp32 reference: float32 rounding gives K3 ~1e-12 (max |dlogp| a few 1e-6)
K3_MAX = 1e-9
DIFFERS = "runs, but its float32 log-probs are not the model's (K3 against the float32 reference above 1e-9)"


def check_engine_family(engine: str, family: str, path, rec: dict) -> None:
    def probe():
        if rec["status"] != "ok":
            raise Refused(rec["reason"])
        rollouts = []
        for i, s in enumerate(rec["samples"]):
            ids = np.array(s["token_ids"], np.int32)
            model = np.arange(len(ids)) >= s["prompt_len"]
            logp = np.full(len(ids), np.nan, np.float32)
            logp[model] = s["logp_decode"]
            rollouts.append(
                Rollout(i, str(i), ids, np.where(model, 0, -1).astype(np.int16), model, logp, s["finish_reason"])
            )
        scorer = ReferenceScorer(path, ReferenceSpec(dtype="float32", logits_fp32=True, device="cpu"))
        scores = scorer.score(rollouts, LogprobSemantics("raw"))
        scorer.close()
        decode = np.concatenate([s["logp_decode"] for s in rec["samples"]])
        prefill = np.concatenate([s["logp_prefill"] for s in rec["samples"]])
        train = np.concatenate([lp[r.is_model_token] for lp, r in zip(scores.logp, rollouts)])
        k3, k3_prefill = token_terms(train, decode).k3.mean(), token_terms(train, prefill).k3.mean()
        detail = (
            f"K3 {k3:.1e} (decode), {k3_prefill:.1e} (prefill) against the reference, max |Δ log p| "
            f"{np.abs(train - decode).max():.2g}; decode vs its own prefill {np.abs(decode - prefill).max():.2g}"
        )
        print(f"{engine} {family}: {len(decode)} tokens, {detail}, {rec['seconds']} s")
        assert len(decode) >= 50 and np.isfinite(decode).all() and np.isfinite(prefill).all()
        if k3 > K3_MAX or k3_prefill > K3_MAX:
            raise Differs(DIFFERS, detail)

    model_support.run(family, engine, probe)


@pytest.fixture(scope="module")
def vllm_families(zoo, tmp_path_factory):
    return run_families("vllm", sys.executable, zoo.all(), tmp_path_factory.mktemp("vllm-families"))


@pytest.fixture(scope="module")
def sglang_families(zoo, tmp_path_factory):
    return run_families("sglang", SGLANG_PYTHON, zoo.all(), tmp_path_factory.mktemp("sglang-families"))


@pytest.mark.vllm
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_family(family, zoo, vllm_families):
    check_engine_family("vllm", family, zoo[family], vllm_families[family])


@pytest.mark.sglang
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sglang_family(family, zoo, sglang_families):
    check_engine_family("sglang", family, zoo[family], sglang_families[family])
