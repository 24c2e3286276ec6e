#!/usr/bin/env bash
# Regenerate the committed example runs from a clean tree (their run.json names the commit).
#
#   bash reports/regenerate.sh            # from the repository root, with .venv built as README says
#   bash reports/regenerate.sh --render   # when only the rendering changed: re-render, no engine
#
# Refuses when the package code differs from the commit (the runs would say "-dirty"). run.json and
# the reports record no absolute paths by themselves; the engines' own logs print the paths they
# were given, so the checkout's root is cut from engine.log and reference.log here, as a reader
# of a committed example would see it in their own clone.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain --untracked-files=no -- mismatch_probe pyproject.toml)" ]; then
  echo "the package code has uncommitted changes: commit them first, so the examples name a commit" >&2
  exit 2
fi
mp=.venv/bin/mismatch-probe
if [ "${1:-}" = "--render" ]; then
  # only the rendering changed: the same runs' figures, report.md and report.html, and the comparisons
  for run in reports/example reports/example-fp32 reports/parallelism-tp2/learner-{tp2,sp2,tp1}; do $mp report "$run"; done
  $mp report reports/example reports/example-fp32 --out reports/example-compare.html
  $mp report reports/parallelism-tp2/learner-{tp2,sp2,tp1} --out reports/parallelism-tp2/compare.html
  for run in reports/sweep-demo/points/*/; do $mp report "$run"; done
  $mp report reports/sweep-demo  # sweep.md and sweep.html from sweep.json
  for run in reports/sync-sweep/points/*/; do $mp report "$run"; done
  $mp report reports/sync-sweep
  for run in reports/precision/points/*/; do $mp report "$run"; done
  $mp report reports/precision
  for run in reports/gpu-h100/{bf16,fp16} reports/gpu-h200/{bf16,fp16}; do $mp report "$run"; done
  $mp report reports/gpu-h{100,200}/bf16 reports/gpu-h{100,200}/fp16 --out reports/gpu-compare.html
  for run in reports/timeline-drift/runs/*/; do $mp report "$run"; done
  $mp report reports/timeline-drift  # timeline.md and timeline.html from timeline.json and steps.parquet
  exit 0
fi
# reports/gpu-h100 and reports/gpu-h200 need a GPU machine: bash benchmarks/gpu_check.sh there
$mp compare probes/demo.toml --out reports/example --overwrite
$mp compare probes/demo.toml --engine-dtype float32 --out reports/example-fp32 --overwrite
$mp report reports/example reports/example-fp32 --out reports/example-compare.html
$mp compare probes/parallelism-tp2.toml --out reports/parallelism-tp2 --overwrite
$mp sweep probes/sweep-demo.toml --gate probes/gate-strict.toml --no-resume
$mp sweep probes/sync-sweep.toml --no-resume
$mp sweep probes/precision.toml --no-resume
# a synthetic 200-step run whose mismatch triples from step 121 (tests/dumps/synthetic_run.py), as a timeline
rm -rf build/timeline-drift-dump reports/timeline-drift
.venv/bin/python tests/dumps/synthetic_run.py build/timeline-drift-dump --format generic --steps 200 --drift-at 121 --factor 3
$mp timeline build/timeline-drift-dump --format generic --model fixtures/models/tiny-qwen2 --out reports/timeline-drift --worst 2
root="$PWD/"
find reports/example reports/example-fp32 reports/parallelism-tp2 reports/sweep-demo reports/sync-sweep reports/precision reports/timeline-drift \
  \( -name engine.log -o -name reference.log -o -path "*/engines/*.log" \) -exec sed -i "s|$root||g" {} +
if grep -rlF "$root" reports/example reports/example-fp32 reports/parallelism-tp2 reports/sweep-demo reports/sync-sweep reports/precision reports/timeline-drift reports/example-compare.html; then
  echo "absolute paths of this checkout are left in the files above" >&2
  exit 1
fi
