"""Benchmarks cannot rot: every script of benchmarks/ (a ``.py`` file with a ``__main__`` block, found
in the directory, not listed here) offers ``--smoke``, a size that runs in seconds, and runs at it
end to end: the same functions called and the same output printed as at full size, on the fixture
model, each in a fresh interpreter as a user runs it. A script a code change broke fails here.

A smoke run checks correctness (the script's own checks, its exit status), never speed: the
performance bounds a script prints hold only at full size. The scripts that start an engine carry
its marker (skipped with the reason where it is absent) and start it once, in the engine worker.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time

import pytest
from conftest import ROOT

BENCHMARKS = ROOT / "benchmarks"
MAIN = re.compile(r"^if __name__ == ['\"]__main__['\"]:", re.MULTILINE)
# what is in benchmarks/ and has no smoke run, and why
EXEMPT = {
    # a lent CUDA GPU machine's whole check (runs, determinism, pytest -m gpu, timings on the GPU):
    # it needs a CUDA GPU, which CI has not; the scripts it calls are smoked here on the CPU
    "gpu_check.sh": "needs a CUDA GPU (the lent GPU machine's check)",
}
# the scripts whose smoke size starts an engine (one start each): the engine's marker
ENGINES = {"bench_run_cost.py": "vllm", "bench_sweep.py": "vllm", "bench_sync.py": "vllm", "engine_matrix.py": "vllm"}
sys.path.insert(0, str(BENCHMARKS))
from smoke import HELP as SMOKE_HELP

TIMEOUT_S = 600


def scripts() -> list[str]:
    return sorted(p.name for p in BENCHMARKS.glob("*.py") if MAIN.search(p.read_text()))


def marked(name: str):
    engine = ENGINES.get(name)
    return pytest.param(name, id=name, marks=[getattr(pytest.mark, engine)] if engine else [])


def run(name: str, *args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def failure(proc: subprocess.CompletedProcess, what: str) -> str:
    return (
        f"{what} exited {proc.returncode}; stderr's tail:\n{proc.stderr[-4000:]}\nstdout's tail:\n{proc.stdout[-1500:]}"
    )


def test_the_scripts_are_found_and_every_other_file_is_a_helper_or_exempt():
    found = scripts()
    assert len(found) >= 15 and "bench_metrics.py" in found  # the discovery sees the scripts
    assert set(ENGINES) <= set(found), "an engine-marked script is no script of benchmarks/"
    others = {p.name for p in BENCHMARKS.iterdir() if p.is_file()} - set(found)
    helpers = {name for name in others if name.endswith(".py")}  # modules the scripts import
    assert others - helpers == set(EXEMPT), "a file of benchmarks/ is neither a smoked script nor exempt"


def test_every_script_offers_the_one_smoke_flag():
    """Each script takes --smoke from benchmarks/smoke.py (one wording; its smoke run below shows it works)."""
    lacking = [name for name in scripts() if "smoke.add_flag(" not in (BENCHMARKS / name).read_text()]
    assert not lacking, f"scripts without benchmarks/smoke.py's --smoke flag: {lacking}"
    proc = run("bench_drift.py", "--help", timeout=120)
    assert proc.returncode == 0 and SMOKE_HELP in " ".join(proc.stdout.split()), failure(proc, "--help")


@pytest.mark.parametrize("name", [marked(name) for name in scripts()])
def test_the_script_runs_at_its_smoke_size(name):
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run(name, "--smoke")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, failure(proc, f"{name} --smoke")
    assert proc.stdout.strip() or proc.stderr.strip(), f"{name} --smoke printed nothing"
    # what it costs CI (with -s): the wall time, and the CPU time of the script and every process it waited for
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"{name} --smoke: {time.perf_counter() - t0:.1f} s wall, {cpu:.1f} s CPU")
