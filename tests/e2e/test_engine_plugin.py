"""A third-party engine adapter, installed as a package of its own (examples/engine-plugin, built
and installed here with pip into a directory of its own), is found through the
``mismatch_probe.engines`` entry-point group: `mismatch-probe engines` lists it and a probe runs on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from conftest import DENSE, ROOT, SINGLE_TURN, cli


def test_an_installed_plugin_is_listed_and_runs_a_probe(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT / "examples" / "engine-plugin", source)  # the build leaves files beside the source
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, source],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}

    listed = cli("engines", env=env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if "example-hf" in line)
    assert "yes" in row

    out = tmp_path / "run"
    run = cli(
        "compare",
        "--engine",
        "example-hf",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--max-prompts",
        "3",
        "--max-tokens",
        "8",
        "--engine-dtype",
        "float32",
        "--train-dtype",
        "float32",
        "--out",
        str(out),
        "--json",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["status"] == "complete" and record["engine"]["engine"] == "example-hf"
    assert record["metrics"]["n_model_tokens"] > 0
    # float32 on both sides, one forward per token against one packed forward: agreement to rounding
    assert 0 <= record["metrics"]["k3_kl"] < 1e-6 and record["metrics"]["prob_diff_max"] < 1e-4
    assert "cannot re-score" in record["decode_vs_prefill"]["skipped"]

    refused = cli(
        "compare", "--engine", "example-hf", "--tp", "2", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), env=env
    )
    assert (
        refused.returncode == 2 and "engine 'example-hf' has no setting engine.tensor_parallel_size" in refused.stderr
    )
