"""The real engines of tests/engines/, each started once per test session and shared by every test
that uses it (a start costs ~15-80 s on 2 cores). tests/conftest.py imports these fixtures and
calls the scheduling hooks, so they are registered once, at the session's root.

Each engine is the same configuration the engine-specific suites used before: the fixture's dense
model in bf16 with processed log-probs (log_softmax of logits / T), behind the worker process as
a user's run has it. Right after the start it samples one batch (``first``), which a second,
freshly started engine of the same settings must repeat (the determinism check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import DENSE, SGLANG_PYTHON

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines import Completion, GenerationRequest, get_entry
from mismatch_probe.engines.process import EngineProcess


def vllm_spec(**kw) -> EngineSpec:
    return EngineSpec(name="vllm", dtype="bfloat16", logprobs_mode="processed", enforce_eager=True, **kw)


def sglang_spec(**kw) -> EngineSpec:
    return EngineSpec(**{"name": "sglang", "python": SGLANG_PYTHON, "dtype": "bfloat16", **kw})


def hf_spec(**kw) -> EngineSpec:
    return EngineSpec(**{"name": "hf", "dtype": "bfloat16", **kw})


# the shared engines that start ready to take a weight sync (tests/engines/test_*_sync.py)
SYNCED = ("vllm", "sglang")


@dataclass(frozen=True)
class Config:
    """How one engine is started for the shared tests, and the sampling they use with it."""

    name: str
    spec: Callable[..., EngineSpec]  # the engine's settings, with overrides
    shared: dict  # the overrides of the shared engine's settings
    probe: dict  # the overrides a probe spec run on the shared engine states (what a user's spec says)
    sampling: SamplingSpec

    def start(self, log_path) -> EngineProcess:
        # vLLM and SGLang ready their weight-update path (a worker extension, a custom loader; the
        # numerics are the same), so the sync tests can digest and sync the shared engine
        sync = SyncSpec(start_from="perturbed") if self.name in SYNCED else None
        return EngineProcess(get_entry(self.name), DENSE, self.spec(**self.shared), log_path=log_path, sync=sync)


CONFIGS = {
    # no memory settings for vLLM: on its CPU build mismatch-probe sizes the KV cache itself (what the
    # run needs, capped by the NUMA node's free memory), which is what these tests rely on
    "hf": Config(
        "hf",
        hf_spec,
        {"logprobs_mode": "processed"},
        {"logprobs_mode": "processed"},
        SamplingSpec(temperature=0.7, top_p=1.0, top_k=0, max_tokens=48, seed=5),
    ),
    "vllm": Config(
        "vllm",
        vllm_spec,
        {"extra_args": {"seed": 11}},
        {},
        SamplingSpec(temperature=0.7, top_p=0.9, top_k=0, max_tokens=48, seed=5),
    ),
    "sglang": Config(
        "sglang",
        sglang_spec,
        {"logprobs_mode": "processed"},
        {"logprobs_mode": "processed"},
        SamplingSpec(temperature=0.7, top_p=1.0, top_k=0, max_tokens=48, seed=5),
    ),
}

FIRST_PROMPTS = [np.array([1, 7, 80 + k, 90], np.int32) for k in range(6)]


def first_batch(engine: EngineProcess, sampling: SamplingSpec) -> list[Completion]:
    """The batch each engine samples right after its start (seed 1, 24 tokens at most)."""
    return engine.generate([GenerationRequest(p, 24) for p in FIRST_PROMPTS], sampling, stop_token_ids=[2], seed=1)


@dataclass
class SharedEngine:
    config: Config
    process: EngineProcess
    first: list[Completion]

    @property
    def name(self) -> str:
        return self.config.name


class _Pool:
    """The started engines. An engine starts when a test first asks for it and stops right after the
    last test that uses it (``group_and_schedule`` puts those tests together), so that an idle engine
    (SGLang's CPU scheduler polls) never slows the tests after it."""

    def __init__(self):
        self.started: dict[str, SharedEngine] = {}
        self.last_user: dict[str, str] = {}  # engine name -> node id of the last test that uses it

    def get(self, name: str, tmp_path_factory) -> SharedEngine:
        if name not in self.started:
            config = CONFIGS[name]
            eng = config.start(tmp_path_factory.mktemp(name) / "engine.log")
            try:
                self.started[name] = SharedEngine(config, eng, first_batch(eng, config.sampling))
            except BaseException:
                eng.close()
                raise
        return self.started[name]

    def close(self, name: str) -> None:
        if (shared := self.started.pop(name, None)) is not None:
            shared.process.close()

    def close_all(self) -> None:
        for name in list(self.started):
            self.close(name)


POOL = _Pool()


def engine_used(item) -> str | None:
    """The shared engine a collected test uses: a ``<name>_engine`` fixture, or the conformance
    suite's ``engine`` parameter; or a ``<name>_server`` fixture (tests/engines/test_remote_servers.py:
    a module's server of that engine starts once when its tests run in one worker, as the engine's do)."""
    for name in CONFIGS:
        if f"{name}_engine" in item.fixturenames or f"{name}_server" in item.fixturenames:
            return name
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("engine") if "engine" in item.fixturenames and params.get("engine") in CONFIGS else None


def group_and_schedule(items) -> None:
    """Run the tests of each shared engine one after another (hf, vllm, sglang; the other tests keep
    their order, after them) and note each engine's last test."""
    order = list(CONFIGS)
    first = next((i for i, item in enumerate(items) if engine_used(item)), None)
    if first is None:
        return
    users = sorted((item for item in items if engine_used(item)), key=lambda item: order.index(engine_used(item)))
    rest = [item for item in items[first:] if not engine_used(item)]
    items[first:] = users + rest
    POOL.last_user = {engine_used(item): item.nodeid for item in users}


def after_test(item) -> None:
    name = engine_used(item)
    if name is not None and POOL.last_user.get(name) == item.nodeid:
        POOL.close(name)


@pytest.fixture
def hf_engine(tmp_path_factory) -> SharedEngine:
    return POOL.get("hf", tmp_path_factory)


@pytest.fixture
def vllm_engine(tmp_path_factory) -> SharedEngine:
    return POOL.get("vllm", tmp_path_factory)


@pytest.fixture
def sglang_engine(tmp_path_factory) -> SharedEngine:
    return POOL.get("sglang", tmp_path_factory)
