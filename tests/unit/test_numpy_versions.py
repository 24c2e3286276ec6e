"""The package runs on NumPy 1.26 and 2.x, and the README test command's NumPy 1 step tests it: the
NumPy it installs (tests/numpy1/requirements.txt) is the one it expects (MISMATCH_PROBE_EXPECT_NUMPY,
checked by tests/conftest.py) and the floor pyproject.toml declares."""

from __future__ import annotations

import io
import re
import tomllib
import zipfile

import numpy as np
import pytest
import torch
from conftest import ROOT, numpy_mismatch

from mismatch_probe.dumps import slime

PINNED = re.search(r"^numpy==([\d.]+)", (ROOT / "tests/numpy1/requirements.txt").read_text(), re.MULTILINE)


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text().split("<!-- ci:test-command -->", 1)[1]
    return text.split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_numpy_1_step_expects_the_numpy_it_installs_from_an_absolute_path():
    assert PINNED, "tests/numpy1/requirements.txt pins no numpy"
    step = re.search(r"bash tests/numpy1/install.sh (\S+) && (.*?) && ", readme_test_command())
    assert step, "the README test command has no NumPy 1 step"
    site, run = step.groups()
    assert f"MISMATCH_PROBE_EXPECT_NUMPY={PINNED.group(1)} " in run
    assert f'PYTHONPATH="$PWD/{site}" ' in run  # absolute: subprocesses in other directories keep it
    assert "-m pytest tests/unit" in run and f"{site}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_pyproject_declares_the_tested_floor():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (numpy,) = [d for d in deps if re.match(r"numpy\b", d)]
    minor = ".".join(PINNED.group(1).split(".")[:2]) if PINNED else None
    assert numpy == f"numpy>={minor}"


def test_the_guard_refuses_any_other_numpy():
    assert numpy_mismatch("1.26", "1.26.4") is None and numpy_mismatch("1.26.4", "1.26.4") is None
    for version in ("2.3.5", "1.260.0", "1.25.2"):
        assert "MISMATCH_PROBE_EXPECT_NUMPY=1.26, but this session imports NumPy " + version in (
            numpy_mismatch("1.26", version) or ""
        )


@pytest.mark.parametrize("module", ["numpy._core.multiarray", "numpy.core.multiarray"])
def test_a_torch_dump_of_numpy_arrays_loads_whichever_numpy_pickled_it(tmp_path, module):
    """NumPy 2 pickles an array as numpy._core.multiarray._reconstruct, NumPy 1 as numpy.core's: a
    slime .pt with NumPy arrays (older routed experts) written under either loads under this NumPy."""
    buf = io.BytesIO()
    torch.save({"experts": np.arange(6, dtype=np.int32).reshape(2, 3)}, buf)
    dump = tmp_path / "rollout.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(dump, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):  # protocol 2: a global is its module's name, as text
                data = re.sub(rb"cnumpy\.(_core|core)\.multiarray\n", b"c" + module.encode() + b"\n", data)
                assert module.encode() + b"\n_reconstruct" in data
            dst.writestr(info, data)
    assert slime._load(dump)["experts"].tolist() == [[0, 1, 2], [3, 4, 5]]
