#!/usr/bin/env bash
# Everything measured on a lent GPU machine, in one call (its image: Python 3.12, torch with CUDA,
# transformers, the data libraries; no vLLM or SGLang, no package index). From the repository root:
#
#   bash benchmarks/gpu_check.sh h200 full   # runs, determinism, pytest -m gpu, timings
#   bash benchmarks/gpu_check.sh h100        # runs and determinism
#
# Wheels the image lacks (pydantic and its needs) travel in .whl/ (the device tool's README says
# how to fetch them); the project is installed without dependencies, against the image's packages.
# .gpu-commit names the commit that travelled. Writes reports/gpu-<kind>/{bf16,fp16} and,
# under $OUT (default /tmp/gpu-check), gpu-<kind>.tar.gz with those runs, every step's log and the
# benchmarks' JSON. A failed step is reported and the next one runs.
set -uo pipefail
kind=${1:?which GPU: h100 or h200}
full=${2:-}
out=${OUT:-/tmp/gpu-check}
work=$(mktemp -d)/gpu-$kind
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/install.log" 2>&1 ||
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the device copy's .git need not be this checkout's (one held an older HEAD): .gpu-commit, written
# just before the call (git rev-parse HEAD > .gpu-commit), names the commit that travelled
[ -f .gpu-commit ] && export MISMATCH_PROBE_GIT_COMMIT=$(cat .gpu-commit)

step() { # step NAME SECONDS COMMAND...: its log in $work/NAME.log, its tail here
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  tail -n "${TAIL:-12}" "$work/$name.log"
  pack # after every step, so a call cut short still brings back what it finished
}
pack() {
  echo "$PWD" >"$work/root.txt" # the runs' logs name this checkout's path; cut it when committing them
  rm -rf "$work/runs" && { [ -d "reports/gpu-$kind" ] && cp -r "reports/gpu-$kind" "$work/runs"; }
  tar -czf "$out/gpu-$kind.tar.gz" -C "$(dirname "$work")" "gpu-$kind"
}

step env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "
import json, torch, transformers; from mismatch_probe.environment import fingerprint
print(torch.__version__, transformers.__version__, torch.version.cuda)
print(json.dumps({k: v for k, v in fingerprint().items() if k != \"packages\"}, indent=1))"'
step compare-bf16 300 python3 -m mismatch_probe compare probes/gpu.toml --out "reports/gpu-$kind/bf16" --overwrite
step compare-fp16 300 python3 -m mismatch_probe compare probes/gpu.toml --engine-dtype float16 --out "reports/gpu-$kind/fp16" --overwrite
TAIL=26 step determinism 300 python3 benchmarks/bench_determinism.py --device cuda --json "$work/determinism.json"
if [ "$full" = full ]; then
  TAIL=20 step pytest-gpu 420 python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -q --junitxml "$work/pytest-gpu.xml"
  TAIL=9 step reference-bf16 300 python3 benchmarks/bench_reference.py --device cuda --dtype bfloat16 --json "$work/reference-bf16.json"
  TAIL=9 step reference-fp32 300 python3 benchmarks/bench_reference.py --device cuda --dtype float32 --json "$work/reference-fp32.json"
  step shaped-model 300 python3 benchmarks/random_checkpoint.py --out /tmp/qwen2.5-0.5b-shaped
  TAIL=9 step reference-0.5b 300 python3 benchmarks/bench_reference.py --device cuda --dtype bfloat16 \
    --model /tmp/qwen2.5-0.5b-shaped --json "$work/reference-0.5b-bf16.json"
fi
ls -la "$out"
