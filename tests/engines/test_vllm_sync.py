"""vLLM's weight-sync path for real (engines/vllm.py: ``sync_weights``; the worker extension of
engines/vllm_sync.py runs in vLLM's worker process), with every fault of ``weight_sync.FAULTS``
named by ``analysis/sync.py: weight_findings``.

The dense faults run on the session's shared vLLM engine (tests/engine_fixtures.py: it starts ready
to sync): its digest as loaded is the fresh one; each test first syncs the perturbed checkpoint in
(the weights of the previous step), then the model with the fault, and the last one syncs the model
back clean, bit for bit as loaded. The MoE model gets one engine of its own.

What the probe found on vLLM 0.32's CPU build, and these tests pin:
- the CPU build repacks linear weights for its GEMMs at load, and its in-place update (the layerwise
  reload, under ``reload_weights`` and our bucketed ``load_weights`` alike) does not re-process a
  layer that received nothing: a tied LM head (a module of its own sharing the embedding's parameter)
  keeps applying the weights it was loaded with (``lm_head.weight[kernel]``);
- its fused-MoE experts (``w13_weight``, ``w2_weight``) come out of an in-place update different
  from a fresh load, and the log-probs with them (several nats on the fixture): on this build every
  MoE sync is broken, so an expert permutation shows as those experts differing, not by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DENSE, ROOT
from engine_fixtures import vllm_spec

from mismatch_probe.analysis.sync import weight_findings
from mismatch_probe.config.spec import SyncSpec
from mismatch_probe.engines import get_entry
from mismatch_probe.engines import weight_sync as ws
from mismatch_probe.engines.base import ScoreRequest, check_sync
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.engines.vllm import CAPABILITIES
from mismatch_probe.errors import ConfigError

pytestmark = pytest.mark.vllm

MOE = ROOT / "fixtures/models/tiny-qwen3-moe"
HEAD_KERNEL = ("not_updated", ("lm_head.weight[kernel]",))
EXPECTED = {
    "skip": {("not_updated", ("model.layers.0.mlp.down_proj.weight",))},
    "float16": {
        ("precision", ("model.embed_tokens.weight",)),
        ("precision", ("model.embed_tokens.weight[kernel]",)),
    },
    "swap_gate_up": {("permuted_rows", ("model.layers.0.mlp.gate_up_proj.weight",))},
    "swap_kv": {
        ("permuted_rows", ("model.layers.0.self_attn.qkv_proj.weight",)),
        ("permuted_rows", ("model.layers.0.self_attn.qkv_proj.bias",)),
    },
    "untie_lm_head": {("untied_lm_head", ("lm_head.weight",))},
    None: set(),  # last: the shared engine is left as it was loaded
}
PROMPTS = [ScoreRequest(np.array([1, 7, 80 + k, 90, 100, 200, 300, 5, 9, 11], np.int32), 1) for k in range(6)]


def named(found: list[dict]) -> set[tuple[str, tuple[str, ...]]]:
    return {(f["kind"], tuple(f["parameters"])) for f in found}


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    return ws.perturbed_checkpoint(DENSE, tmp_path_factory.mktemp("vllm-sync") / "perturbed")


FRESH: dict[int, dict] = {}  # the shared engine's digest as loaded, taken by the first test


@pytest.fixture
def fresh(vllm_engine, tmp_path_factory):
    key = id(vllm_engine.process)
    if key not in FRESH:
        FRESH[key] = vllm_engine.process.weight_digest(tmp_path_factory.mktemp("vllm-fresh") / "fresh.npz")
    return FRESH[key]


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_sync_faults_are_named(vllm_engine, fresh, start, fault, tmp_path):
    """From the previous step's weights, a sync (clean, or committing ``fault``) leaves exactly the
    named findings; the engine reports what it loaded and resets its prefix cache."""
    engine = vllm_engine.process
    engine.sync_weights(start, tmp_path / "back")
    before = engine.weight_digest(tmp_path / "before.npz")
    report = engine.sync_weights(DENSE, tmp_path / "sync", fault=fault)
    assert report["transfer"] == "tensor" and report["buckets"] >= 1 and report["fault"] == fault
    assert report["reset_prefix_cache"] == {"call": "LLM.reset_prefix_cache", "result": True}
    assert report["tensors"] == len(list(ws.checkpoint_tensors(DENSE))) - (fault == "skip")
    after = engine.weight_digest(tmp_path / "after.npz")
    differing, found = weight_findings(before, after, fresh)
    # the shared engine was loaded from the model, so its LM head's kernel is the model's throughout
    assert named(found) == EXPECTED[fault], found
    assert set(differing) == {p for _, ps in EXPECTED[fault] for p in ps}
    if fault is None:
        assert not differing and report["engine_report"]["not_loaded"] == []


def test_moe_sync_on_the_cpu_build(tmp_path, monkeypatch):
    """The MoE model: started from the perturbed checkpoint, synced to the model (the stale LM-head
    kernel, and the experts vLLM's CPU build does not restore), and with the experts permuted.

    Its engine core and model runner run in the engine worker ("uni"; the CPU build needs
    VLLM_ENABLE_V1_MULTIPROCESSING=0 for it): the same CPU worker and update path as the default
    (mp) executor, which the dense faults above take on the shared engine, without two more
    processes importing vLLM (~20 s) and ~5 s to stop them."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    start = ws.perturbed_checkpoint(MOE, tmp_path / "perturbed")
    spec = vllm_spec(distributed_executor_backend="uni")
    engine = EngineProcess(
        get_entry("vllm"), MOE, spec, log_path=tmp_path / "engine.log", sync=SyncSpec(start_from="perturbed")
    )
    try:
        fresh = engine.weight_digest(tmp_path / "fresh.npz")
        fresh_logp = np.concatenate(engine.prefill_logprobs(PROMPTS))
        engine.sync_weights(start, tmp_path / "a")
        before = engine.weight_digest(tmp_path / "before.npz")
        engine.sync_weights(MOE, tmp_path / "b")
        _, clean = weight_findings(before, engine.weight_digest(tmp_path / "clean.npz"), fresh, n_experts=8)
        synced_logp = np.concatenate(engine.prefill_logprobs(PROMPTS))
        engine.sync_weights(start, tmp_path / "c")
        engine.sync_weights(MOE, tmp_path / "d", fault="permute_experts")
        _, permuted = weight_findings(before, engine.weight_digest(tmp_path / "perm.npz"), fresh, n_experts=8)
    finally:
        engine.close()
    experts = {p for k, ps in named(clean) if k == "weights_differ" for p in ps}
    assert experts and all("experts" in p for p in experts), clean
    assert np.abs(synced_logp - fresh_logp).max() > 0.1  # the broken experts show in the log-probs
    assert {p for _, ps in named(permuted) for p in ps} >= experts  # the permuted layer is among them


@pytest.mark.parametrize(
    "sync, says",
    [
        (SyncSpec(start_from="perturbed", transfer="nccl"), "needs GPUs"),
        (SyncSpec(start_from="perturbed", sleep_level=1), "sleep mode is not supported on CPU"),
    ],
)
def test_check_sync_refuses_on_cpu(sync, says):
    with pytest.raises(ConfigError, match=says):
        check_sync(sync, CAPABILITIES, engine="vLLM 0.32.0", on_cpu=True)
