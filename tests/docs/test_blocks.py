"""The documentation's code runs: every ``python`` block of README.md, ARCHITECTURE.md and docs/ runs
(a block marked ``<!-- docs:no-run: REASON -->`` is compiled and what it uses of ``mismatch_probe``
checked instead), and every ``bash`` block marked ``<!-- docs:run -->`` runs on CPU and exits 0
(tests/doc_blocks.py says how blocks are marked). They run in a scratch directory holding the
checkout's probes and fixtures and copies of the committed runs, with ``reports/demo`` standing for
the demo's output (README's first command; ``reports/example`` is a committed run of it)."""

from __future__ import annotations

import ast
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from doc_blocks import Block, all_blocks

BLOCKS = all_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.marker != "no-run"]
NOT_RUN = [b for b in BLOCKS if b.lang == "python" and b.marker == "no-run"]
SHELL = [b for b in BLOCKS if b.marker == "run"]
COMMITTED_RUNS = ("example", "example-fp32")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "probes", d / "probes")  # a spec's paths are relative to its file
    (d / "fixtures").symlink_to(ROOT / "fixtures")
    (d / "examples").symlink_to(ROOT / "examples")
    for run in COMMITTED_RUNS:
        shutil.copytree(ROOT / "reports" / run, d / "reports" / run)
    shutil.copytree(ROOT / "reports" / "example", d / "reports" / "demo")
    return d


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # the venv's mismatch-probe
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "MPLBACKEND": "Agg"}


def test_markers_sit_on_the_blocks_they_mean():
    for b in BLOCKS:
        if b.marker == "run":
            assert b.lang in ("bash", "sh"), f"{b.where}: docs:run marks a {b.lang or 'plain'} block"
        if b.marker == "no-run":
            assert b.lang == "python" and b.reason, f"{b.where}: docs:no-run needs a python block and a reason"
    assert len(PYTHON) >= 1 and len(SHELL) >= 3 and len(NOT_RUN) >= 10  # the scan sees them


@pytest.mark.slow
@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_a_runnable_shell_block_runs(block: Block, scratch):
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code], cwd=scratch, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, (
        f"{block.where} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.where)
def test_a_python_block_runs(block: Block, scratch):
    proc = subprocess.run(
        [sys.executable, "-c", block.code], cwd=scratch, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stderr[-3000:]}"


# what a block that is not run may call of the API, by the name it calls it with
def _api() -> dict[str, object]:
    import mismatch_probe
    from mismatch_probe.timeline.monitor import Monitor

    api = {name: getattr(mismatch_probe, name) for name in mismatch_probe.__all__ if name != "__version__"}
    api |= {"log_step": Monitor.log_step, "close": Monitor.close}
    return api


def _bad_uses(tree: ast.AST, api: dict[str, object]) -> list[str]:
    import mismatch_probe

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "mismatch_probe":
            bad += [f"mismatch_probe has no {a.name}" for a in node.names if a.name not in mismatch_probe.__all__]
        named = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if named and node.value.id == "mismatch_probe" and node.attr not in mismatch_probe.__all__:
            bad.append(f"mismatch_probe has no {node.attr}")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name not in api:
                continue
            params = inspect.signature(api[name]).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            bad += [f"{name}() takes no {k.arg}=" for k in node.keywords if k.arg and k.arg not in params]
    return bad


@pytest.mark.parametrize("block", NOT_RUN, ids=lambda b: b.where)
def test_a_block_that_is_not_run_compiles_and_uses_the_api_as_it_is(block: Block):
    tree = ast.parse(block.code, block.where)
    bad = _bad_uses(tree, _api())
    assert not bad, f"{block.where}: {bad}"


def test_the_api_check_finds_a_renamed_keyword_or_name():
    code = (
        "from mismatch_probe import Monitor, Monitr\n"
        "m = Monitor('d', backgrund=True)\n"
        "m.log_step(1, ids, logp_infer=a, logp_tran=b)\n"
    )
    bad = _bad_uses(ast.parse(code), _api())
    assert bad == ["mismatch_probe has no Monitr", "Monitor() takes no backgrund=", "log_step() takes no logp_tran="]
