"""A scripted engine for orchestration tests only (metrics and engines are tested for real)."""

from __future__ import annotations

import numpy as np

from mismatch_probe.engines import NOTHING_OPTIONAL, Completion
from mismatch_probe.modeling.logprobs import LogprobSemantics


class FakeEngine:
    name = "fake"
    capabilities = NOTHING_OPTIONAL
    calls: list[int] = []  # requests per generate() call, across instances
    fail_on_call: int | None = None
    logprob = float(np.log(0.5))
    echo_prompt_offset = 0

    def __init__(self, model_path, spec, *, trust_remote_code=False):
        self.spec = spec

    def semantics(self, sampling):
        return LogprobSemantics("raw")

    def info(self):
        return {"engine": "fake", "dtype": "float32"}

    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        FakeEngine.calls.append(len(requests))
        if FakeEngine.fail_on_call is not None and len(FakeEngine.calls) == FakeEngine.fail_on_call:
            raise RuntimeError("engine crashed")
        out = []
        for r in requests:
            n = min(4, r.max_tokens)
            toks = np.array([10 + i for i in range(n - 1)] + [stop_token_ids[0]], np.int32)
            out.append(
                Completion(
                    toks,
                    np.full(n, FakeEngine.logprob, np.float32),
                    "stop",
                    prompt_token_ids=r.prompt_token_ids + FakeEngine.echo_prompt_offset,
                )
            )
        if on_progress:
            on_progress(len(requests))
        return out

    def close(self):
        pass
