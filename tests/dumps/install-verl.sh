#!/usr/bin/env bash
# Test support: verl's DataProto (and what `import verl.protocol` needs) into the directory $1
# (default .verl-site), for the verl import tests' dump builder (tests/dumps/verl_dump.py), which
# runs it with PYTHONPATH=$1 on top of .venv. --no-deps: the rest (torch, numpy, transformers) is
# .venv's; nothing is installed into .venv itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${1:-.verl-site}"
python="${PYTHON:-.venv/bin/python}"
if PYTHONPATH="$target" "$python" -c "import verl.protocol" 2>/dev/null; then
  exit 0  # already there
fi
rm -rf "$target"
"$python" -m pip install -q --no-deps --target "$target" -r tests/dumps/verl-requirements.txt
PYTHONPATH="$target" "$python" -c "from verl.protocol import DataProto"
