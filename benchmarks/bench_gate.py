"""Time of ``mismatch-probe gate`` on a large synthetic run.

    python benchmarks/bench_gate.py [--tokens 10000000]

Checks on run.json values cost nothing that grows with the run; a statistic over sequences
streams the per-token table once (shared by all such checks). This times both through the real
CLI, as a CI job would run them, with the shipped default thresholds and with run.json-only checks.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import smoke  # benchmarks/smoke.py: the --smoke flag
from bench_report import make_run

SMOKE = {"tokens": 50_000, "repeats": 1}

VALUE_ONLY = """
[[checks]]
metric = "k3_kl"
op = "<="
threshold = 1e-3

[[checks]]
metric = "corrections.token_tis_clipped_share"
op = "<="
threshold = 0.01
"""


def timed_gate(run: Path, thresholds: Path) -> tuple[float, int]:
    exe = Path(sys.executable).with_name("mismatch-probe")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(exe), "gate", str(run), "--thresholds", str(thresholds), "--json"], capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # 0: every check passed, 1: one failed; anything else is no gate at all
        sys.exit(f"gate --thresholds {thresholds} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return seconds, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=2, help="gate runs per thresholds file (the best is shown)")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        stats = make_run(run, args.tokens, 0)
        values = Path(tmp) / "values.toml"
        values.write_text(VALUE_ONLY)
        print(f"synthetic run: {args.tokens:,} rows, {stats['n_model_tokens']:,} model tokens")
        for name, path in (
            ("run.json checks only", values),
            ("probes/gate-default.toml (one p99 over sequences)", ROOT / "probes" / "gate-default.toml"),
        ):
            seconds, rc = min(timed_gate(run, path) for _ in range(args.repeats))
            print(f"gate, {name}: {seconds:.2f} s wall (exit {rc}), interpreter start and imports included")


if __name__ == "__main__":
    main()
