#!/usr/bin/env bash
# Test support: NumPy 1.26 and the packages of .venv that refuse it (tests/numpy1/requirements.txt
# says which and why) into the directory $1 (default .numpy1-site), for the README test command's
# NumPy 1 step, which runs the fast tests with it first on PYTHONPATH over .venv:
#
#   bash tests/numpy1/install.sh .numpy1-site
#   MISMATCH_PROBE_EXPECT_NUMPY=1.26.4 PYTHONPATH="$PWD/.numpy1-site" .venv/bin/python -m pytest tests/unit tests/frameworks -m "not slow"
#
# The absolute path: tests that start `mismatch-probe` in another directory keep NumPy 1;
# MISMATCH_PROBE_EXPECT_NUMPY makes tests/conftest.py refuse a session that imported another NumPy.
set -euo pipefail
cd "$(dirname "$0")/../.."
target="${1:-.numpy1-site}"
python="${PYTHON:-.venv/bin/python}"
requirements=tests/numpy1/requirements.txt

# already there: every pinned distribution is in $target at its pinned version (metadata only)
if [ -d "$target" ] && "$python" tests/site_has_pins.py "$target" "$requirements"; then
  exit 0
fi
rm -rf "$target"
"$python" -m pip install -q --disable-pip-version-check --no-deps --target "$target" -r "$requirements"
