"""Every family in a real engine's CPU build (vLLM, SGLang), one child process for all of them.

An engine start through the worker process costs 11-30 s on 2 cores, most of it importing the
engine and spawning its own processes; fifteen of them would take minutes. So the conformance
suite runs one child (under the engine's own interpreter) that imports the engine once and, for
each family in turn, builds the project's adapter (``VLLMEngine`` / ``SGLangEngine``, exactly the
class the worker process runs), samples, scores by prefill, and closes it: 2-5 s a family. Each
family's outcome goes to a JSON-lines file as soon as it is known; a child that dies (an engine
abort) is restarted on the families after the one it died on, which is recorded as crashed.

vLLM runs its engine core in the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the "uni"
executor). SGLang always starts a scheduler and a detokenizer process, which it *spawns* (each
importing SGLang again, ~13 s); here they are forked from the child that has SGLang imported
(CPU only: no CUDA context to inherit), a model that fails to load raises instead of SGLang
killing the whole process tree (``custom_sigquit_handler``), and the reason is the scheduler's
last error in the log, as the worker process reports it.

    python tests/families/engine_families.py ENGINE RESULTS.jsonl LOG FAMILY=PATH ...   (the child)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 32
N_PROMPTS = 4
SEED = 3


def engine_spec(engine: str):
    from mismatch_probe.config.spec import EngineSpec

    if engine == "vllm":
        # the engine core and its model runner in this process: no engine-core or worker processes
        return EngineSpec(
            name="vllm", dtype="float32", logprobs_mode="raw", enforce_eager=True, distributed_executor_backend="uni"
        )
    return EngineSpec(
        name="sglang", dtype="float32", logprobs_mode="raw", extra_args={"custom_sigquit_handler": _on_sigquit}
    )


def child_env(engine: str) -> dict:
    if engine == "vllm":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {"SGLANG_USE_CPU_ENGINE": "1"}  # as the adapter sets it, before SGLang is imported


SIGQUITS: list[int] = []  # SGLang's children that failed to start


def _on_sigquit(*_) -> None:
    SIGQUITS.append(1)


def _fork_sglang_children() -> None:
    """SGLang sets the "spawn" start method right before it starts its children; make it "fork".
    A private function: if a newer SGLang moved it, the children are spawned (slower, same results)."""
    import multiprocessing as mp

    from sglang.srt.entrypoints import engine as sglang_engine

    set_envs = getattr(sglang_engine, "_set_envs_and_config", None)
    if set_envs is not None:

        def set_envs_then_fork(server_args):
            set_envs(server_args)
            mp.set_start_method("fork", force=True)

        sglang_engine._set_envs_and_config = set_envs_then_fork
    import sglang.srt.models.registry  # noqa: F401  (every model module once, not in each child)


def _after_failed_sglang_start(log: Path) -> str | None:
    """Stop what a failed start left behind; the scheduler's own error from the log, if it died."""
    import gc

    import zmq
    from sglang.srt.utils import kill_process_tree

    from mismatch_probe.engines.process import log_errors

    kill_process_tree(os.getpid(), include_parent=False)
    for obj in gc.get_objects():  # a failed start's ZMQ context would block its finalizer forever
        if isinstance(obj, zmq.Context) and not obj.closed:
            obj.destroy(linger=0)
    if SIGQUITS:
        errors = log_errors(log)
        return _bare_error_in_log(errors[-1], log) if errors else None
    return None


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "message", None) or exc).strip().splitlines()
    if text:
        return f"{type(exc).__name__}: {text[0]}"
    frame = traceback.extract_tb(exc.__traceback__)[-1]  # a bare assert: say where it is
    return f"{type(exc).__name__} in {Path(frame.filename).name} {frame.name}(): {frame.line}"


def _bare_error_in_log(line: str, log: Path) -> str:
    """A bare exception line from the log, with the innermost frame of the traceback before it."""
    if ":" in line:
        return line
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)\n\s+(.+)', log.read_text(errors="replace"))
    return f"{line} in {Path(frames[-1][0]).name} {frames[-1][1]}(): {frames[-1][2].strip()}" if frames else line


def run_family(engine: str, path: Path, log: Path) -> dict:
    """Sample N_PROMPTS fixture prompts (T = 1, raw log-probs) and score them by prefill."""
    from mismatch_probe.config.spec import SamplingSpec
    from mismatch_probe.engines import GenerationRequest, ScoreRequest, load_engine
    from mismatch_probe.modeling.loading import load_tokenizer, stop_token_ids
    from mismatch_probe.rollout.prompts import tokenize_prompts

    tok = load_tokenizer(path)
    prompts = tokenize_prompts(
        ROOT / "fixtures" / "prompts" / "single_turn.jsonl",
        tok,
        max_prompts=N_PROMPTS,
        max_model_len=1024,
        max_new_tokens=MAX_TOKENS,
    )
    adapter, phase, t0 = None, "start", time.perf_counter()
    out: dict = {"status": "ok"}
    SIGQUITS.clear()
    try:
        adapter = load_engine(engine)(path, engine_spec(engine))
        phase = "generate"
        sampled = adapter.generate(
            [GenerationRequest(p.token_ids, MAX_TOKENS) for p in prompts],
            SamplingSpec(temperature=1.0, max_tokens=MAX_TOKENS, seed=SEED),
            stop_token_ids=stop_token_ids(path, tok),
            seed=SEED,
        )
        phase = "prefill"
        full = [np.concatenate([p.token_ids, c.token_ids]).astype(np.int32) for p, c in zip(prompts, sampled)]
        prefill = adapter.prefill_logprobs([ScoreRequest(f, len(p.token_ids)) for f, p in zip(full, prompts)])
        out["samples"] = [
            {
                "prompt_len": len(p.token_ids),
                "token_ids": f.tolist(),
                "logp_decode": c.logprobs.tolist(),
                "logp_prefill": lp.tolist(),
                "finish_reason": c.finish_reason,
            }
            for p, c, f, lp in zip(prompts, sampled, full, prefill)
        ]
        out["info"] = {k: str(v) for k, v in adapter.info().items() if k in ("dtype", "attention_backend", "versions")}
    except Exception as exc:  # the engine's refusal, in its own words
        reason = _one_line(exc)
        if engine == "sglang" and adapter is None:
            reason = _after_failed_sglang_start(log) or reason
        out = {"status": "refused", "reason": f"[{phase}] {reason}"}
    finally:
        if adapter is not None:
            try:
                adapter.close()
            except Exception:
                pass
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def child(engine: str, results: Path, log: Path, jobs: list[str]) -> None:
    if engine == "sglang":
        _fork_sglang_children()
    if engine == "vllm":
        # vLLM inspects each architecture it has not cached in a fresh interpreter (another ~8 s
        # import) to keep CUDA out of the caller; on a CPU build there is no CUDA to keep out
        try:
            from vllm.model_executor.models import registry

            registry._run_in_subprocess = lambda fn: fn()
        except (ImportError, AttributeError):
            pass
    for job in jobs:
        family, path = job.split("=", 1)
        with open(results, "a") as f:  # "started" first: a crash is then pinned on this family
            f.write(json.dumps({"family": family, "status": "started"}) + "\n")
        rec = {"family": family, **run_family(engine, Path(path), log)}
        with open(results, "a") as f:
            f.write(json.dumps(rec) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # an engine's leftover threads must not turn the exit into a crash


def run_families(engine: str, python: str, paths: dict[str, Path], workdir: Path, timeout_s: float = 900) -> dict:
    """``{family: record}`` for every family: "ok" with the samples, "refused" or "crashed" with the reason."""
    results, log = workdir / f"{engine}-families.jsonl", workdir / f"{engine}-families.log"
    env = {
        **os.environ,
        **child_env(engine),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    found: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while todo := [f for f in paths if f not in found]:
        cmd = [python, __file__, engine, str(results), str(log), *(f"{f}={paths[f]}" for f in todo)]
        with open(log, "ab") as lf:
            code = subprocess.run(
                cmd, stdout=lf, stderr=lf, env=env, timeout=max(deadline - time.monotonic(), 1)
            ).returncode
        lines = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
        found.update({r["family"]: r for r in lines if r["status"] != "started"})
        died_on = [r["family"] for r in lines if r["status"] == "started" and r["family"] not in found]
        if died_on:
            found[died_on[-1]] = {
                "family": died_on[-1],
                "status": "crashed",
                "reason": f"the engine process died (exit code {code})",
            }
        elif todo == [f for f in paths if f not in found]:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the {engine} child exited {code} before any family:\n{tail}")
    return found


if __name__ == "__main__":
    child(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
