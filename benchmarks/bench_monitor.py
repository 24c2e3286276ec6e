"""What ``Monitor.log_step`` costs a trainer, against what scoring the same tokens costs the reference.

    python benchmarks/bench_monitor.py [--sequences 1024] [--response 1024] [--score-sequences 4] [--json PATH]

One step of ``--sequences`` sequences, each a 64-token prompt and ``--response`` generated tokens
(1024 x 1024: 1,048,576 generated tokens), as a trainer holds it: padded float32 torch tensors. It
times, in one run:

- ``log_step`` in the caller's thread (the default): reduce, write the step's rows and its 8
  sampled sequences (median of ``--repeats`` steps); and one refresh (``flush``: steps.parquet,
  drift, timeline.json, the page), which the default ``flush_every=50`` spreads over 50 steps;
- ``log_step`` with ``background=True``: the caller's part (convert, check, copy, queue) and the
  worker's (the rest), each per step;
- the reference (``reference/scorer.py: ReferenceScorer``, the project's default settings: bfloat16,
  packed) on a Qwen2.5-0.5B-shaped model with random weights (``benchmarks/random_checkpoint.py``,
  nothing downloaded), scoring ``--score-sequences`` of the sequences after a warm-up; its time per
  sequence times ``--sequences`` is the time to score the step (every sequence has the same length,
  so the same attention cost).

Prints the seconds and the ratio log_step / reference; the issue's bound is 2%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import smoke  # benchmarks/smoke.py: the --smoke flag

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.table.tokens import Rollout
from mismatch_probe.timeline.monitor import Monitor

PROMPT = 64
LIKE = "qwen2.5-0.5b"
# the fixture model, not a 1 GB random checkpoint
SMOKE = {
    "sequences": 8,
    "response": 64,
    "score_sequences": 2,
    "repeats": 1,
    "model": ROOT / "fixtures/models/tiny-qwen2",
}


def step_tensors(n: int, response: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """A padded step: prompt then response; mismatch of bf16-vs-fp32 size, some sequences worse."""
    g = torch.Generator().manual_seed(seed)
    width = PROMPT + response
    ids = torch.randint(3, vocab, (n, width), generator=g)
    mask = torch.zeros(n, width, dtype=torch.bool)
    mask[:, PROMPT:] = True
    logp_infer = torch.log(torch.rand(n, width, generator=g).clamp(min=1e-6)) * 0.3
    logp_train = (logp_infer + 0.02 * torch.randn(n, width, generator=g)).clamp(max=0.0)
    return {"token_ids": ids, "logp_infer": logp_infer, "logp_train": logp_train, "mask": mask}


def time_log_step(out: Path, steps: list[dict], **options) -> tuple[list[float], float, float]:
    """Seconds of each log_step call, of the flush after them, and the monitor's own count of its
    time on the steps (with ``background``: the callers' parts and the worker's)."""
    monitor = Monitor(out, flush_every=10**9, **options)
    calls = []
    for k, s in enumerate(steps):
        t0 = time.perf_counter()
        monitor.log_step(k, s["token_ids"], s["logp_infer"], s["logp_train"], s["mask"])
        calls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    monitor.flush()
    flush = time.perf_counter() - t0
    monitor.close()
    return calls, flush, monitor._seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=1024)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--score-sequences", type=int, default=4, help="sequences the reference scores (timed)")
    ap.add_argument("--repeats", type=int, default=3, help="log_step calls timed (one step each)")
    ap.add_argument("--model", type=Path, help="a checkpoint (default: a random Qwen2.5-0.5B-shaped one)")
    ap.add_argument("--json", type=Path)
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    with tempfile.TemporaryDirectory(prefix="bench-monitor-") as tmp:  # the checkpoint: 1 GB
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    model = args.model
    if model is None:
        from random_checkpoint import build

        model = build(tmp / "model", LIKE)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    name = f"{LIKE}-shaped, random weights" if args.model is None else model.name

    steps = [step_tensors(args.sequences, args.response, vocab, seed) for seed in range(args.repeats)]
    n_tokens = int(steps[0]["mask"].sum())
    sync, flush, _ = time_log_step(tmp / "sync", steps)
    caller, _, both = time_log_step(tmp / "background", steps, background=True, queue_size=len(steps))
    worker = (both - sum(caller)) / len(steps)
    log_step = statistics.median(sync)

    scorer = ReferenceScorer(model, ReferenceSpec(device="cpu" if not torch.cuda.is_available() else "auto"))
    ids = steps[0]["token_ids"].numpy().astype(np.int32)
    mask = steps[0]["mask"].numpy()
    rollouts = [
        Rollout(
            i,
            str(i),
            ids[i],
            np.where(mask[i], 0, -1).astype(np.int16),
            mask[i],
            np.zeros(ids.shape[1], np.float32),
            "length",
        )
        for i in range(args.score_sequences + 1)
    ]
    semantics = LogprobSemantics("raw")
    scorer.score(rollouts[:1], semantics)  # warm-up
    if scorer.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    scorer.score(rollouts[1:], semantics)
    if scorer.device.startswith("cuda"):
        torch.cuda.synchronize()
    per_sequence = (time.perf_counter() - t0) / args.score_sequences
    reference = per_sequence * args.sequences

    where = (
        torch.cuda.get_device_name() if scorer.device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    )
    amortized = log_step + flush / 50
    print(
        f"one step: {args.sequences} sequences x ({PROMPT} prompt + {args.response} generated) tokens = "
        f"{n_tokens:,} generated tokens; {where}"
    )
    print(
        f"  log_step (caller's thread)        {log_step:8.3f} s  (median of {len(sync)}: {', '.join(f'{t:.3f}' for t in sync)})"
    )
    print(f"  flush (every flush_every=50 steps) {flush:8.3f} s  -> {flush / 50:.3f} s a step")
    print(f"  background: the caller's part     {statistics.median(caller):8.3f} s; the worker's {worker:.3f} s a step")
    print(
        f"  reference ({name}, {scorer.spec.dtype}, packed): {per_sequence:.3f} s a sequence "
        f"({args.score_sequences} timed) -> {reference:8.1f} s for the step"
    )
    print(f"  log_step / reference: {log_step / reference:.3%} (with the flush: {amortized / reference:.3%}); bound 2%")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": where,
                    "model": name,
                    "tokens": n_tokens,
                    "log_step_s": log_step,
                    "log_step_runs_s": sync,
                    "flush_s": flush,
                    "background_caller_s": statistics.median(caller),
                    "background_worker_s": worker,
                    "reference_s_per_sequence": per_sequence,
                    "reference_s": reference,
                    "ratio": log_step / reference,
                    "ratio_with_flush": amortized / reference,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
