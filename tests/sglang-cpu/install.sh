#!/usr/bin/env bash
# Test support for CPU-only machines: a venv in which SGLang's own CPU engine runs from PyPI wheels.
#
#   bash tests/sglang-cpu/install.sh .venv-sglang     # then: --engine-python .venv-sglang/bin/python
#
# GPU machines install SGLang normally (pip install 'mismatch-probe[sglang]'); none of this is
# needed there. On a CPU-only machine SGLang's wheel pins a CUDA torch and CUDA-only packages,
# and PyPI has no CPU build of sgl-kernel, so this script:
#   1. keeps torch 2.13.0+cpu and installs mismatch-probe (the engine worker runs from this venv);
#   2. installs SGLang and torchvision with --no-deps, then the pure-Python requirements SGLang's
#      CPU engine imports (requirements.txt, pinned);
#   3. copies site-packages/ into the venv: a stand-in `sgl_kernel` with the two CPU helpers the
#      engine calls (plain tensor code; anything else fails loudly), and import hooks that define
#      torchvision's nms/qnms op schemas so the CUDA torchvision's pure-Python part loads, and that
#      allocate the routed-experts capture buffer on CPU without cudaHostRegister (so the engine can
#      return MoE routing here; engines/sglang.py records it as a workaround).
# SGLang then runs its torch-native kernels (attention_backend=torch_native): dense models such
# as Qwen2 and Llama work; fused MoE, speculative decoding and Mamba layers need the real kernels.
set -euo pipefail
venv=${1:?usage: bash tests/sglang-cpu/install.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.29.1  # the newest the machine's pip constraints allow (torchvision<=0.29.1); only its pure-Python part is used

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0+cpu -e "$root"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
"${pip[@]}" torch==2.13.0+cpu -r "$here/requirements.txt"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -r "$here/site-packages/." "$site/"

# fail here, with SGLang's own message, rather than in the first test
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c '
import sglang, torch
from sglang.srt.entrypoints.engine import Engine  # noqa: F401
print(f"SGLang {sglang.__version__} (CPU engine, torch {torch.__version__}) ready in", __import__("sys").prefix)'
