"""Engines that misbehave on purpose, loaded by the real worker process (tests/ is on its PYTHONPATH)."""

from __future__ import annotations

import os
import sys

import numpy as np

from mismatch_probe.engines import NOTHING_OPTIONAL, Completion
from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.logprobs import LogprobSemantics

CALLS_FILE = "MISMATCH_PROBE_TEST_CALLS"  # env: a file counting generate() calls across worker processes


def _count_call() -> int:
    path = os.environ[CALLS_FILE]
    n = (int(open(path).read() or 0) if os.path.exists(path) else 0) + 1
    with open(path, "w") as f:
        f.write(str(n))
    return n


class _Scripted:
    capabilities = NOTHING_OPTIONAL

    def __init__(self, model_path, spec, *, trust_remote_code=False):
        self.spec = spec

    def semantics(self, sampling):
        return LogprobSemantics("raw")

    def info(self):
        return {"engine": type(self).__name__, "dtype": "float32", "routing": None}

    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        out = []
        for r in requests:
            toks = np.array([10, 11, stop_token_ids[0]], np.int32)
            out.append(Completion(toks, np.full(3, -0.5, np.float32), "stop", prompt_token_ids=r.prompt_token_ids))
        if on_progress:
            on_progress(len(requests))
        return out

    def close(self):
        pass


class DiesOnSecondShard(_Scripted):
    """Like an engine whose process is killed by a CUDA fault: it prints the cause, then exits."""

    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        if _count_call() == 2:
            print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
            os._exit(3)
        return super().generate(requests, sampling, stop_token_ids=stop_token_ids, seed=seed, on_progress=on_progress)


class RaisesOnGenerate(_Scripted):
    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        raise ValueError("max_num_batched_tokens (16) is smaller than max_model_len (512)")


class RefusesSetting(_Scripted):
    def __init__(self, model_path, spec, *, trust_remote_code=False):
        raise ConfigError("this build has no such kernel", hint="drop the flag")


class KilledOnGenerate(_Scripted):
    """Like the kernel's OOM killer: no message, just SIGKILL."""

    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
