"""The engine worker: ``python -m mismatch_probe.engines.worker --requests-fd R --replies-fd W``.

Started by :class:`mismatch_probe.engines.process.EngineProcess`, possibly under another
interpreter (``--engine-python``). It hosts one engine adapter for the whole run and answers
requests on its own pipe pair; its stdout and stderr (the engine's logs) go to the run's
``engine.log``, never into the protocol. It exits when asked to close or when the parent goes away.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import resource
import sys
import traceback

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines import wire
from mismatch_probe.engines.base import EngineCapabilities, check_sync
from mismatch_probe.errors import ConfigError, ProbeError
from mismatch_probe.version import __version__


def _load(target: str):
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _declared(cls, target: str) -> EngineCapabilities:
    """What the adapter class declares it can do (ARCHITECTURE.md, Engine contract)."""
    try:
        declared = cls.capabilities
    except AttributeError:
        declared = None
    if not isinstance(declared, EngineCapabilities):
        raise ConfigError(
            f"the engine adapter {target} declares no capabilities",
            hint="give its class capabilities = EngineCapabilities(...) (mismatch_probe.engines.base; "
            "EngineCapabilities() when it has nothing optional)",
        )
    return declared


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux; children counts the engine's own worker processes once reaped
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024, 1)


def serve(requests, replies) -> bool:
    """Answer requests until the parent closes the engine (True) or goes away (False)."""
    wire.send(
        replies,
        {
            "op": "hello",
            "protocol": wire.PROTOCOL_VERSION,
            "version": __version__,
            "python": sys.executable,
            "pid": os.getpid(),
        },
    )
    engine = None
    while True:
        msg = wire.receive(requests)
        if msg is None:  # the parent is gone: nothing left to answer
            break
        h = msg.header
        op = h["op"]
        try:
            if op == "start":
                spec = EngineSpec(**h["spec"])
                cls = _load(h["target"])
                declared = _declared(cls, h["target"])
                # an adapter that keeps state between runs (a remote engine's answers received) gets a place for it
                state: dict = {"state_dir": h["state_dir"]} if h.get("state_dir") and declared.keeps_state else {}
                if h.get("sync"):  # a [sync] probe: the adapter readies its weight-update path
                    sync = SyncSpec(**h["sync"])
                    if declared.sync is None:  # refused here; the adapter checks the rest where it knows its platform
                        check_sync(sync, declared, engine=f"engine {spec.name!r}", on_cpu=None)
                    state["sync"] = sync
                engine = cls(h["model"], spec, trust_remote_code=h["trust_remote_code"], **state)
                # the instance's: an adapter may narrow its class's (a remote engine's, by its dialect)
                wire.send(replies, {"op": "started", "capabilities": engine.capabilities.to_header()})
            elif op == "sync_weights":
                started = engine.sync
                if h.get("transfer"):  # this sync only (the transfer needs nothing at the start)
                    engine.sync = started.model_copy(update={"transfer": h["transfer"]})
                try:
                    report = engine.sync_weights(h["weights_dir"], h["work_dir"], fault=h.get("fault"))
                finally:
                    engine.sync = started
                wire.send(replies, {"op": "synced", "report": report})
            elif op == "reset_prefix_cache":
                wire.send(replies, {"op": "reset", "report": engine.reset_prefix_cache()})
            elif op == "weight_digest":
                import numpy as np

                np.savez(h["path"], **engine.weight_digest())
                wire.send(replies, {"op": "digested", "path": h["path"]})
            elif op == "info":
                wire.send(replies, {"op": "info", "info": engine.info()})
            elif op == "semantics":
                semantics = engine.semantics(SamplingSpec(**h["sampling"]))
                wire.send(replies, {"op": "semantics", "semantics": dataclasses.asdict(semantics)})
            elif op == "generate":
                completions = engine.generate(
                    wire.table_to_requests(msg.table),
                    SamplingSpec(**h["sampling"]),
                    stop_token_ids=h["stop_token_ids"],
                    seed=h["seed"],
                    on_progress=lambda n: wire.send(replies, {"op": "progress", "n": n}),
                )
                wire.send(replies, {"op": "generated"}, wire.completions_to_table(completions))
            elif op == "prefill":
                logprobs = engine.prefill_logprobs(
                    wire.table_to_score_requests(msg.table),
                    on_progress=lambda n: wire.send(replies, {"op": "progress", "n": n}),
                )
                wire.send(replies, {"op": "prefilled"}, wire.logprobs_to_table(logprobs))
            elif op == "close":
                if engine is not None:
                    engine.close()
                    engine = None
                wire.send(replies, {"op": "closed", "peak_rss_mib": _peak_rss_mib()})
                return True
            else:
                raise ValueError(f"unknown request {op!r}")
        except BaseException as exc:  # every failure is reported to the parent
            traceback.print_exc()  # the full story goes to engine.log
            wire.send(
                replies,
                {
                    "op": "error",
                    "during": op,
                    "type": type(exc).__name__,
                    "message": str(getattr(exc, "message", exc))[:4000],
                    "probe_error": isinstance(exc, ProbeError),
                    "exit_code": getattr(exc, "exit_code", None),
                    "hint": getattr(exc, "hint", None),
                },
            )
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                break
    return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mismatch_probe.engines.worker")
    parser.add_argument("--requests-fd", type=int, required=True)
    parser.add_argument("--replies-fd", type=int, required=True)
    args = parser.parse_args(argv)
    requests = os.fdopen(args.requests_fd, "rb")
    replies = os.fdopen(args.replies_fd, "wb")
    # Anything a library prints to stdout joins stderr (engine.log) instead of the protocol pipe.
    os.dup2(2, 1)
    if serve(requests, replies):
        # The engine was shut down through its own API and the parent has its answer. Interpreter
        # teardown can still abort in a native destructor of a thread the engine left behind (vLLM's
        # CPU build at TP=2: "terminate called without an active exception", exit -6, now and then),
        # which would read as a crash; there is nothing left to finalize, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":  # the engine may spawn processes that re-import __main__
    main()
