"""What a `mismatch-probe compare` run costs, stage by stage, against the three bounds of issue 56:

    python benchmarks/bench_run_cost.py --model /tmp/shapes/qwen2.5-0.5b [--max-prompts 16 --n 2 --max-tokens 64]
    python benchmarks/bench_run_cost.py --smoke     # the fixture, 4 prompts x 2 samples x 16 tokens

The run is the library's compare (prepare, sample, score, analyze, render: mismatch_probe/pipeline/
stages.py), in this process as the CLI runs it: vLLM in bfloat16 as the engine (its worker a child
process), against a float32 reference with a float32 LM head, on the checkpoint given (the fixture,
or one of fixtures/shapes.py's). Each stage's wall time is the run's own (run.json's ``timings``);
memory is sampled here: the peak RSS of this process per stage (the kernel's high-water mark,
reset at each stage) and of the engine worker's process tree (its processes' PSS summed, so
shared pages count once, sampled every 100 ms; the worker's own ru_maxrss is printed too).

The bounds, each printed with its margin:

(a) the probe's own overhead (all but the engine: its start, generation, prefill and stop; and the
    reference: its load and forward) is at most 5% of the run. The engine's stop is the engine's:
    vLLM's executor waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 s) for its workers to exit;
(b) the reference forward takes at most 1.5x the engine's prefill of the same tokens;
(c) the reference's peak memory (this process's RSS while the reference is loaded and scoring) is
    at most its weights (float32) + 2 GiB.

Bounds hold at full size only: at --smoke the fixture's forward is a few milliseconds, so fixed
costs dominate. ``--json PATH`` writes the figures; ``--profile`` runs the score stage under
cProfile and prints its top functions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1024**3
SMOKE = {"max_prompts": 4, "n": 2, "max_tokens": 16}  # on the fixture (the default --model)
# the stages of the table, in run order: run.json's timing key, and the row's name
ROWS = (
    ("setup_s", "setup (checks, tokenizer, prompts)"),
    ("engine_start_s", "engine start"),
    ("generation_s", "generation"),
    ("prefill_s", "engine prefill (same tokens)"),
    ("engine_stop_s", "engine stop"),
    ("reference_load_s", "reference load"),
    ("scoring_s", "reference forward (scoring)"),
    ("metrics_s", "analysis"),
    ("figures_s", "figures"),
    ("report_s", "report render"),
)
ENGINE_WORK = ("engine_start_s", "generation_s", "prefill_s", "engine_stop_s", "reference_load_s", "scoring_s")


def rss_high_water() -> int:
    """This process's peak RSS since the last reset (bytes)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class Memory:
    """Peak memory per label: this process's RSS high-water mark (reset at each label), and the
    children's (the engine worker and its processes) PSS summed, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.1) -> None:
        import psutil

        self.me = psutil.Process()
        self.interval = interval
        self.label = "setup_s"
        self.cli: dict[str, int] = {}
        self.children: dict[str, int] = {}
        self.lock = threading.Lock()
        self.exact = reset_high_water()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(self.interval):
            total = 0
            for p in self.me.children(recursive=True):
                try:
                    total += p.memory_full_info().pss  # shared pages counted once across the tree
                except Exception:  # it exited between the listing and the read
                    pass
            rss = self.me.memory_info().rss
            with self.lock:
                self.children[self.label] = max(self.children.get(self.label, 0), total)
                if not self.exact:
                    self.cli[self.label] = max(self.cli.get(self.label, 0), rss)

    def mark(self, label: str) -> None:
        """The memory from here on is ``label``'s."""
        with self.lock:
            if self.exact:
                self.cli[self.label] = max(self.cli.get(self.label, 0), rss_high_water())
                reset_high_water()
            self.label = label

    def close(self) -> None:
        self.mark("end")
        self.stop.set()
        self.thread.join()


def instrument(memory: Memory) -> None:
    """Label memory by the run's own timing blocks: ``timed(timings, key)`` in the stages marks ``key``."""
    from mismatch_probe.pipeline import rollouts, runs, stages

    original = runs.timed

    @contextmanager
    def labelled(timings: dict, key: str) -> Iterator[None]:
        previous = memory.label
        memory.mark(key)
        try:
            with original(timings, key):
                yield
        finally:
            memory.mark(previous)

    stages.timed = labelled  # type: ignore[assignment]
    rollouts.timed = labelled  # type: ignore[assignment]


def weight_bytes(model: Path, dtype_bytes: int = 4) -> int:
    """The checkpoint's parameters at ``dtype_bytes`` each (the float32 reference's weights)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                shape = st.get_slice(key).get_shape()
                count = 1
                for d in shape:
                    count *= d
                n += count
    return n * dtype_bytes


def make_spec(args: argparse.Namespace, out: Path):
    from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file

    spec = load_spec_file(ROOT / "probes" / "demo.toml")  # vLLM bf16 vs a float32 reference, fp32 LM head
    return apply_overrides(
        spec,
        {
            "model": str(args.model),
            "prompts": str(args.prompts),
            "out": str(out),
            "name": f"run-cost-{args.model.name}",
            "max_prompts": args.max_prompts,
            "sampling.n": args.n,
            "sampling.max_tokens": args.max_tokens,
            "engine.dtype": "bfloat16",
            "engine.prefill_check": True,
            "reference.dtype": "float32",
            "reference.logits_fp32": True,
        },
        named_by="key",
    )


def run(args: argparse.Namespace, out: Path) -> dict:
    from mismatch_probe.pipeline import stages

    spec = make_spec(args, out)
    memory = Memory()
    instrument(memory)
    wall: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        for name, call in (
            ("prepare", lambda: stages.prepare(spec, overwrite=True)),
            ("sample", lambda: stages.sample(ctx)),
            ("score", lambda: profiled(stages.score, ctx) if args.profile else stages.score(ctx)),
            ("analyze", lambda: stages.analyze(ctx)),
            ("render", lambda: stages.render(ctx, dist)),
        ):
            memory.mark(f"{name} (other)" if name != "prepare" else "setup_s")
            t = time.perf_counter()
            result = call()
            wall[name] = time.perf_counter() - t
            if name == "prepare":
                ctx = result
            elif name == "analyze":
                dist = result
    finally:
        memory.close()
    total = time.perf_counter() - t0
    record = ctx.record
    timings = dict(ctx.timings)
    engine = record.engine_process or {}
    return {
        "model": str(args.model),
        "params": {"max_prompts": args.max_prompts, "n": args.n, "max_tokens": args.max_tokens},
        "samples": len(ctx.inputs.prompts) * args.n if ctx.inputs else None,
        "timings": timings,
        "stage_wall_s": wall,
        "total_s": total,
        "cli_peak_rss": memory.cli,
        "engine_tree_peak_rss": memory.children,
        "engine_worker_peak_rss_mib": engine.get("peak_rss_mib"),
        "reference_peak_memory": record.reference.to_dict().get("peak_memory") if record.reference else None,
        "weights_fp32_bytes": weight_bytes(Path(args.model)),
        "exact_cli_peaks": memory.exact,
        "run_dir": str(out),
    }


def profiled(fn, *a):
    import cProfile
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, *a)
    finally:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)


def tokens_scored(run_dir: Path) -> dict:
    import pyarrow.compute as pc

    from mismatch_probe.api import load_run

    table = load_run(run_dir).tokens_table(["is_model_token"])
    return {"tokens": table.num_rows, "response_tokens": int(pc.sum(table.column("is_model_token")).as_py() or 0)}


def bounds(fig: dict) -> dict:
    t = fig["timings"]
    total = fig["total_s"]
    work = sum(t.get(k, 0.0) for k in ENGINE_WORK)
    overhead = total - work
    ref_keys = ("reference_load_s", "scoring_s", "score (other)")
    ref_peak = max(fig["cli_peak_rss"].get(k, 0) for k in ref_keys)
    limit = fig["weights_fp32_bytes"] + 2 * GIB
    prefill = t.get("prefill_s") or float("nan")
    return {
        "a_overhead": {
            "seconds": overhead,
            "share": overhead / total,
            "bound": 0.05,
            "holds": overhead / total <= 0.05,
        },
        "b_forward_vs_prefill": {
            "ratio": t.get("scoring_s", 0.0) / prefill,
            "bound": 1.5,
            "holds": t.get("scoring_s", 0.0) / prefill <= 1.5,
        },
        "c_reference_memory": {
            "peak_bytes": ref_peak,
            "limit_bytes": limit,
            "weights_fp32_bytes": fig["weights_fp32_bytes"],
            "holds": ref_peak <= limit,
        },
    }


def table(fig: dict) -> str:
    t, cli, kids = fig["timings"], fig["cli_peak_rss"], fig["engine_tree_peak_rss"]
    total = fig["total_s"]

    def gib(b: int | None) -> str:
        return f"{b / GIB:.2f}" if b else "-"

    lines = [
        "| stage | wall s | share | CLI peak RSS GiB | engine worker tree peak PSS GiB |",
        "|---|---:|---:|---:|---:|",
    ]
    accounted = 0.0
    for key, name in ROWS:
        if key not in t:
            continue
        accounted += t[key]
        lines.append(f"| {name} | {t[key]:.2f} | {t[key] / total:.1%} | {gib(cli.get(key))} | {gib(kids.get(key))} |")
    rest = total - accounted
    other_cli = max((v for k, v in cli.items() if k.endswith("(other)")), default=0)
    other_kids = max((v for k, v in kids.items() if k.endswith("(other)")), default=0)
    lines.append(
        f"| the rest (shard I/O, records, stage glue) | {rest:.2f} | {rest / total:.1%} | {gib(other_cli)} | "
        f"{gib(other_kids)} |"
    )
    lines.append(f"| **total** | **{total:.2f}** | 100% | {gib(max(cli.values()))} | {gib(max(kids.values()))} |")
    return "\n".join(lines)


def report(fig: dict) -> str:
    b = fig["bounds"]
    a, bb, c = b["a_overhead"], b["b_forward_vs_prefill"], b["c_reference_memory"]

    def ok(holds: bool) -> str:
        return "holds" if holds else "MISSED"

    worker = fig["engine_worker_peak_rss_mib"]
    head = (
        f"{Path(fig['model']).name}: {fig['samples']} samples ({fig['params']}), {fig['tokens']['tokens']} tokens "
        f"({fig['tokens']['response_tokens']} sampled), {fig['cpu']}"
    )
    lines = [head, "", table(fig), ""]
    if worker:
        lines.append(
            f"engine worker's own peak RSS (ru_maxrss; itself, or its largest reaped child): {worker / 1024:.2f} GiB"
        )
    lines.append(f"(a) probe overhead {a['seconds']:.2f} s = {a['share']:.1%} of the run (bound 5%): {ok(a['holds'])}")
    lines.append(f"(b) reference forward / engine prefill = {bb['ratio']:.2f}x (bound 1.5x): {ok(bb['holds'])}")
    lines.append(
        f"(c) reference peak RSS {c['peak_bytes'] / GIB:.2f} GiB vs fp32 weights {c['weights_fp32_bytes'] / GIB:.2f} "
        f"GiB + 2 GiB = {c['limit_bytes'] / GIB:.2f} GiB: {ok(c['holds'])}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "fixtures" / "models" / "tiny-qwen2")
    ap.add_argument("--prompts", type=Path, default=ROOT / "fixtures" / "prompts" / "all.jsonl")
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, help="the run directory (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true", help="cProfile the score stage")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "run"
        fig = run(args, out)
        fig["tokens"] = tokens_scored(out)
    fig["cpu"] = f"cpu, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads"
    fig["bounds"] = bounds(fig)
    print(report(fig))
    if args.json:
        args.json.write_text(json.dumps(fig, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
