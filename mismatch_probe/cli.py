"""The ``mismatch-probe`` command line: a thin layer over the library API.

Errors the user can fix (:class:`ProbeError`) print one line and exit non-zero; a traceback only
with ``--debug`` or ``MISMATCH_PROBE_DEBUG=1``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from mismatch_probe.errors import ProbeError
from mismatch_probe.files import portable_path, write_atomic

app = typer.Typer(
    name="mismatch-probe",
    help="Measure the probability mismatch between an inference engine and a training forward pass.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()


def _debug() -> bool:
    return os.environ.get("MISMATCH_PROBE_DEBUG", "") not in ("", "0")


def friendly_errors(fn):
    """Turn library errors into one-line messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ProbeError as exc:
            if _debug():
                if getattr(exc, "remote_traceback", ""):  # a reference rank's own traceback
                    err.print(exc.remote_traceback, markup=False, highlight=False)
                raise
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted: completed shards are kept; run the same command again to resume")
            raise typer.Exit(130) from None

    return wrapper


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    if debug:
        os.environ["MISMATCH_PROBE_DEBUG"] = "1"


class RichProgress:
    """Rich progress bars for the pipeline's stages (on stderr, so --json output stays clean)."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.bars = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.tasks:  # the live display starts with the first stage, so early errors print alone
            self.bars.stop()

    def stage(self, name: str, total: int) -> None:
        if not self.tasks:
            self.bars.start()
        if name in self.tasks:  # the next run of a sweep: the same bar again, not one more
            self.bars.reset(self.tasks[name], total=total)
        else:
            self.tasks[name] = self.bars.add_task(name, total=total or None)  # 0: not known ahead

    def advance(self, name: str, amount: int) -> None:
        self.bars.advance(self.tasks[name], amount)

    def log(self, message: str) -> None:
        self.bars.console.log(message)


@app.command()
@friendly_errors
def compare(
    spec_file: Annotated[Path | None, typer.Argument(help="Probe spec (TOML); flags override it.")] = None,
    model: Annotated[Path | None, typer.Option(help="Local Hugging Face checkpoint directory.")] = None,
    engine: Annotated[str | None, typer.Option(help="Inference engine (see `mismatch-probe engines`).")] = None,
    prompts: Annotated[Path | None, typer.Option(help="Prompts file (JSON Lines).")] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default reports/<name>-<time>).")
    ] = None,
    engine_dtype: Annotated[str | None, typer.Option(help="Engine dtype: auto, bfloat16, float16, float32.")] = None,
    train_dtype: Annotated[str | None, typer.Option(help="Reference dtype: bfloat16, float16, float32.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling mass.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Top-k (0 or -1 disables).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Maximum new tokens per response.")] = None,
    n: Annotated[int | None, typer.Option("--n", help="Samples per prompt.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    logprobs_mode: Annotated[
        str | None,
        typer.Option(help="Engine log-probs: raw or processed (default: the engine's; sglang: processed, logits / T)."),
    ] = None,
    engine_python: Annotated[
        Path | None, typer.Option(help="Python of a venv with the engine installed; the engine worker runs there.")
    ] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel size (vllm, sglang).")] = None,
    enforce_eager: Annotated[
        bool | None,
        typer.Option(
            "--enforce-eager/--compiled",
            help="Eager mode, or torch.compile + CUDA graphs (vllm; sglang: disable_cuda_graph; default: the engine's).",
        ),
    ] = None,
    cascade_attn: Annotated[
        bool | None, typer.Option("--cascade-attn/--no-cascade-attn", help="Cascade attention (vllm).")
    ] = None,
    chunked_prefill: Annotated[
        bool | None, typer.Option("--chunked-prefill/--no-chunked-prefill", help="Chunked prefill (vllm, sglang).")
    ] = None,
    prefix_caching: Annotated[
        bool | None,
        typer.Option("--prefix-caching/--no-prefix-caching", help="Prefix caching (vllm; sglang: the radix cache)."),
    ] = None,
    batch_invariant: Annotated[
        bool | None,
        typer.Option(
            "--batch-invariant/--no-batch-invariant",
            help="Batch-invariant kernels (vllm: VLLM_BATCH_INVARIANT=1, GPU builds; sglang: enable_deterministic_inference).",
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(help="Most sequences per engine step (vllm; sglang: max_running_requests).")
    ] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Most tokens per engine step (vllm).")] = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(
            help="Share of accelerator memory the engine may take (vllm: on CPU builds, of the NUMA node's memory; sglang: mem_fraction_static)."
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        str | None, typer.Option(help="KV-cache dtype, e.g. auto, fp8, fp8_e5m2 (vllm, sglang).")
    ] = None,
    quantization: Annotated[
        str | None, typer.Option(help="Weight quantization method, e.g. fp8 (vllm, sglang).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Engine context length (vllm; sglang: context_length).")
    ] = None,
    kv_cache_memory_bytes: Annotated[
        int | None,
        typer.Option(
            help="KV-cache size in bytes per rank (vllm; default on its CPU build: what the run needs, capped at half the NUMA node's free memory)."
        ),
    ] = None,
    attention_backend: Annotated[
        str | None, typer.Option(help="Engine attention backend, e.g. flashinfer, fa3, triton, torch_native (sglang).")
    ] = None,
    rl_on_policy_target: Annotated[
        str | None,
        typer.Option(
            help="SGLang's true on-policy mode for a trainer, e.g. fsdp (sglang; implies deterministic inference)."
        ),
    ] = None,
    engine_logits_fp32: Annotated[
        bool | None,
        typer.Option(
            "--engine-logits-fp32/--no-engine-logits-fp32",
            help="Engine LM head in float32 (sglang: enable_fp32_lm_head).",
        ),
    ] = None,
    max_total_tokens: Annotated[
        int | None, typer.Option(help="Engine KV-cache size in tokens, a memory cap (sglang).")
    ] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(help="A running rollout server to probe instead of starting an engine: http(s)://HOST:PORT."),
    ] = None,
    engine_api: Annotated[
        str | None,
        typer.Option(help="The server's API: openai (vllm serve: /v1/completions) or sglang (/generate)."),
    ] = None,
    engine_model: Annotated[
        str | None, typer.Option(help="The model name requests to the server carry (default: the only one it serves).")
    ] = None,
    engine_api_key_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the server's API key (the key is never recorded).")
    ] = None,
    check_model: Annotated[
        bool | None,
        typer.Option(
            "--check-model/--no-check-model",
            help="Refuse a server whose model is not the checkpoint (names, architectures, tokenizer).",
        ),
    ] = None,
    prefill_check: Annotated[
        bool | None,
        typer.Option(
            "--prefill-check/--no-prefill-check",
            help="Re-score samples with the engine's own prefill (decode vs prefill).",
        ),
    ] = None,
    reference_logprobs: Annotated[
        str | None, typer.Option(help="Reference distribution: engine (match it), raw, temperature, processed.")
    ] = None,
    engine_batch_size: Annotated[int | None, typer.Option(help="Sequences per engine batch (hf).")] = None,
    engine_attn: Annotated[
        str | None,
        typer.Option(
            help="Engine attention implementation (hf): auto (sdpa where the architecture supports it, else eager), sdpa, eager, flex_attention, flash_attention_2/3."
        ),
    ] = None,
    train_attn: Annotated[
        str | None,
        typer.Option(
            help="Reference attention implementation: auto (sdpa where the architecture supports it, else eager), sdpa, eager, flex_attention, flash_attention_2/3."
        ),
    ] = None,
    logits_fp32: Annotated[
        bool | None, typer.Option("--logits-fp32/--no-logits-fp32", help="Reference LM head in float32.")
    ] = None,
    packing: Annotated[
        bool | None,
        typer.Option("--packing/--no-packing", help="Reference padding-free packing vs padded micro-batches."),
    ] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Reference sequences per forward.")] = None,
    train_sp: Annotated[
        int | None,
        typer.Option(
            "--train-sp",
            help="Reference Ulysses sequence-parallel size (ranks share each packed row; needs --packing).",
        ),
    ] = None,
    train_tp: Annotated[
        int | None, typer.Option("--train-tp", help="Reference tensor-parallel size (DTensor column/row-wise plan).")
    ] = None,
    max_prompts: Annotated[int | None, typer.Option(help="Use only the first N prompts.")] = None,
    max_turns: Annotated[
        int | None, typer.Option(help="Assistant turns per sample; tool calls run between turns.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out instead of resuming it.")] = False,
    rollouts_from: Annotated[
        Path | None,
        typer.Option(
            help="Score the rollouts of this run (same model, prompts, engine and sampling) instead of sampling; no engine starts."
        ),
    ] = None,
    gate_file: Annotated[
        Path | None,
        typer.Option("--gate", help="Thresholds file (TOML): gate the finished run on it; exit 1 if a check fails."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run record (run.json) to stdout.")] = False,
) -> None:
    """Sample with an engine, score the same tokens with a training-style forward, report the mismatch."""
    from mismatch_probe.config.spec import ProbeSpec, apply_overrides, load_spec_file
    from mismatch_probe.pipeline import run_compare
    from mismatch_probe.report.model import run_view
    from mismatch_probe.report.terminal import print_run

    gate = None
    if gate_file is not None:  # a bad thresholds file fails now, not after the run
        from mismatch_probe.gate.checks import load_gate

        gate = load_gate(gate_file)
        if gate.needs_baseline:
            from mismatch_probe.errors import ConfigError

            raise ConfigError(
                f"{gate_file} has baseline-relative checks, and compare --gate takes no baseline",
                hint="run compare, then `mismatch-probe gate RUN --thresholds FILE --baseline BASE`",
            )
    spec = load_spec_file(spec_file) if spec_file else ProbeSpec()
    apply_overrides(
        spec,
        {
            # paths as typed: the spec resolves them and records them as given
            "model": model and str(model),
            "prompts": prompts and str(prompts),
            "out": out_dir and str(out_dir),
            "max_prompts": max_prompts,
            "max_turns": max_turns,
            "engine.name": engine,
            "engine.dtype": engine_dtype,
            "engine.logprobs_mode": logprobs_mode,
            "engine.batch_size": engine_batch_size,
            "engine.attn_implementation": engine_attn,
            "engine.python": engine_python and str(engine_python),
            "engine.tensor_parallel_size": tp,
            "engine.enforce_eager": enforce_eager,
            "engine.cascade_attn": cascade_attn,
            "engine.chunked_prefill": chunked_prefill,
            "engine.prefix_caching": prefix_caching,
            "engine.batch_invariant": batch_invariant,
            "engine.max_num_seqs": max_num_seqs,
            "engine.max_num_batched_tokens": max_num_batched_tokens,
            "engine.gpu_memory_utilization": gpu_memory_utilization,
            "engine.kv_cache_dtype": kv_cache_dtype,
            "engine.quantization": quantization,
            "engine.max_model_len": max_model_len,
            "engine.kv_cache_memory_bytes": kv_cache_memory_bytes,
            "engine.attention_backend": attention_backend,
            "engine.rl_on_policy_target": rl_on_policy_target,
            "engine.logits_fp32": engine_logits_fp32,
            "engine.max_total_tokens": max_total_tokens,
            "engine.prefill_check": prefill_check,
            "engine.url": engine_url,
            "engine.api": engine_api,
            "engine.served_model": engine_model,
            "engine.api_key_env": engine_api_key_env,
            "engine.check_model": check_model,
            "reference.logprobs": reference_logprobs,
            "reference.dtype": train_dtype,
            "reference.attn_implementation": train_attn,
            "reference.logits_fp32": logits_fp32,
            "reference.packing": packing,
            "reference.micro_batch_size": micro_batch_size,
            "reference.sequence_parallel_size": train_sp,
            "reference.tensor_parallel_size": train_tp,
            "sampling.temperature": temperature,
            "sampling.top_p": top_p,
            "sampling.top_k": top_k,
            "sampling.max_tokens": max_tokens,
            "sampling.n": n,
            "sampling.seed": seed,
        },
    )
    if spec.variants:
        return _compare_variants(spec, overwrite, rollouts_from, gate_file, gate, as_json)
    with RichProgress(err) as progress:
        result = run_compare(spec, progress=progress, overwrite=overwrite, rollouts_from=rollouts_from)
    if as_json:
        sys.stdout.write(json.dumps(result.record, indent=2) + "\n")
        if gate is not None:
            _gate_exit(_gate(result.run_dir, gate_file, None, gate, quiet=True))
        return
    print_run(out, run_view(result.run, result.run_dir))
    out.print(f"run directory: {escape(portable_path(result.run_dir))}")
    out.print(f"report: {escape(portable_path(result.run_dir / 'report.html'))} (also report.md)")
    if gate is not None:
        _gate_exit(_gate(result.run_dir, gate_file, None, gate))


def _compare_variants(spec, overwrite, rollouts_from, gate_file, gate, as_json) -> None:
    from mismatch_probe.pipeline import run_variants
    from mismatch_probe.report.data import RunData
    from mismatch_probe.report.model import comparison_view, label_runs
    from mismatch_probe.report.terminal import print_comparison

    with RichProgress(err) as progress:
        result = run_variants(spec, progress=progress, overwrite=overwrite, rollouts_from=rollouts_from)
    gated = (
        {name: _gate(r.run_dir, gate_file, None, gate, quiet=True) for name, r in result.runs.items()} if gate else {}
    )
    if as_json:
        sys.stdout.write(json.dumps({name: r.record for name, r in result.runs.items()}, indent=2) + "\n")
    else:
        runs = label_runs([RunData(r.run_dir, r.run, {}) for r in result.runs.values()])
        print_comparison(out, comparison_view(runs, "variants: the same rollouts, scored by each reference"))
        for name, r in result.runs.items():
            out.print(f"{name}: {escape(portable_path(r.run_dir / 'report.html'))}")
        out.print(f"comparison: {escape(portable_path(result.comparison))}")
        from mismatch_probe.gate.junit import rich_table

        for name, g in gated.items():
            out.print(f"gate on {name}:")
            out.print(rich_table(g))
    worst = max((g.exit_code for g in gated.values()), default=0)
    if worst:
        raise typer.Exit(worst)


def _gate(run_dir, thresholds, baseline, gate=None, *, quiet=False, junit=None, markdown=None):
    from mismatch_probe.gate.checks import run_gate
    from mismatch_probe.gate.junit import junit_xml, rich_table
    from mismatch_probe.gate.junit import markdown as render_markdown

    result = run_gate(run_dir, thresholds, baseline, gate)
    if junit is not None:
        write_atomic(junit, junit_xml(result))
    if markdown is not None:
        write_atomic(markdown, render_markdown(result))
    if not quiet:
        out.print(rich_table(result))
    return result


def _gate_exit(result) -> None:
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def parse_settings(pairs: list[str] | None) -> dict[str, object]:
    """``--set section.key=value`` flags as overrides; the value is read as TOML (2, 1e-3, true,
    "text"), or taken as a string when it is not TOML (bfloat16)."""
    import tomllib

    from mismatch_probe.errors import ConfigError

    out: dict[str, object] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r} is not KEY=VALUE", hint="e.g. --set reference.dtype=bfloat16")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[key.strip()] = value
    return out


SET_HELP = "A setting as section.key=value (repeatable), e.g. reference.dtype=bfloat16."


@app.command()
@friendly_errors
def sample(
    spec_file: Annotated[Path, typer.Argument(help="Probe spec (TOML).", show_default=False)],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default reports/<name>-<time>).")
    ] = None,
    settings: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out.")] = False,
) -> None:
    """Stage 1 alone: the engine samples (and re-scores with its prefill) into a run directory;
    `score` and `analyze` take it from there, later or on other machines. `compare` is exactly
    sample + score + analyze."""
    from mismatch_probe.config.spec import apply_overrides, load_spec_file
    from mismatch_probe.pipeline import sample_run

    spec = apply_overrides(
        load_spec_file(spec_file), {"out": str(out_dir) if out_dir else None, **parse_settings(settings)}
    )
    with RichProgress(err) as progress:
        ctx = sample_run(spec, progress=progress, overwrite=overwrite)
    where = escape(portable_path(ctx.out))
    out.print(f"sampled {ctx.record.inputs.n_samples} samples into {where}; next: mismatch-probe score {where}")


@app.command()
@friendly_errors
def score(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with rollouts (from sample).", show_default=False)],
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Score into a new run directory that links RUN_DIR's rollouts (with --set)."),
    ] = None,
    settings: Annotated[
        list[str] | None, typer.Option("--set", help=SET_HELP + " Only \\[reference] and \\[corrections] settings.")
    ] = None,
    model: Annotated[Path | None, typer.Option(help="The checkpoint, when not where the run found it.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out.")] = False,
) -> None:
    """Stage 2 alone: the reference scores the sampled tokens (the missing shards; a re-run resumes).
    With --out and --set, another reference scores the same rollouts into a new run directory.
    Under torchrun (one node or several), the ranks score as data-parallel groups of
    reference.sequence_parallel_size x tensor_parallel_size; RUN_DIR must be on a shared filesystem."""
    from contextlib import nullcontext

    from mismatch_probe.pipeline import Progress, score_run
    from mismatch_probe.reference.launch import torchrun_launch

    launch = torchrun_launch()  # under torchrun, rank 0 alone shows progress and the result
    lead = launch is None or launch.is_lead
    with RichProgress(err) if lead else nullcontext(Progress()) as progress:
        ctx = score_run(
            run_dir,
            out=out_dir,
            overrides=parse_settings(settings),
            model=model,
            progress=progress,
            overwrite=overwrite,
        )
    if not lead:
        return
    where = escape(portable_path(ctx.out))
    out.print(f"scored {ctx.out / 'tokens.parquet'}; next: mismatch-probe analyze {where}")


@app.command()
@friendly_errors
def analyze(
    run_dir: Annotated[Path, typer.Argument(help="A scored run directory (from score).", show_default=False)],
    model: Annotated[Path | None, typer.Option(help="The checkpoint, when not where the run found it.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print run.json instead of the tables.")] = False,
) -> None:
    """Stages 3 and 4 alone: metrics, per-sequence rows and the report of a scored run."""
    from mismatch_probe.pipeline import analyze_existing
    from mismatch_probe.report.model import run_view
    from mismatch_probe.report.terminal import print_run

    with RichProgress(err) as progress:
        result = analyze_existing(run_dir, progress=progress, model=model)
    if as_json:
        sys.stdout.write(json.dumps(result.record, indent=2) + "\n")
        return
    print_run(out, run_view(result.run, result.run_dir))
    out.print(f"report: {escape(portable_path(result.run_dir / 'report.html'))} (also report.md)")


class RichSweepProgress(RichProgress):
    """The stages' bars plus one for the sweep: points done, engine starts, time left."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        super().__init__(console)
        self.points = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("runs · {task.fields[starts]} engine starts · left"),
            TimeRemainingColumn(),
            console=console,
        )
        self.points_task: int | None = None

    def point(self, name: str, done: int, total: int, engine_starts: int) -> None:
        if self.points_task is None:
            self.points_task = self.points.add_task("sweep", total=total, starts=engine_starts)
            self.points.start()
        self.points.update(self.points_task, completed=done, starts=engine_starts)
        self.log(f"sweep: {name} done ({done}/{total} runs, {engine_starts} engine starts)")

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.points_task is not None:
            self.points.stop()


@app.command()
@friendly_errors
def sweep(
    spec_file: Annotated[
        Path,
        typer.Argument(
            help="Probe spec (TOML) with a \\[sweep] table, e.g. probes/sweep-demo.toml.", show_default=False
        ),
    ],
    out_dir: Annotated[Path | None, typer.Option("--out", help="Sweep directory (default: the spec's out).")] = None,
    gate_file: Annotated[
        Path | None,
        typer.Option("--gate", help="Thresholds (TOML): check every point and name the cheapest change that passes."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume/--no-resume", help="Keep the finished points of an earlier sweep in --out.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print sweep.json instead of a summary.")] = False,
) -> None:
    """Vary engine, reference and sampling settings around a spec, one run per point (one engine
    start per engine configuration), and say which setting causes the mismatch, with intervals, the
    noise floor, determinism and each change's throughput cost. Exit 0 when the baseline or a
    recommended change passes --gate, 1 when none does, 2 on bad input."""
    from mismatch_probe.config.spec import load_spec_file
    from mismatch_probe.report.sweep import sweep_view
    from mismatch_probe.report.terminal import print_sweep
    from mismatch_probe.sweeps import sweep as run_sweep

    spec = load_spec_file(spec_file)
    with RichSweepProgress(err) as progress:
        result = run_sweep(spec, out=out_dir, gate=gate_file, resume=resume, progress=progress)
    if as_json:
        sys.stdout.write(json.dumps(result.record.to_dict(), indent=2) + "\n")
    else:
        print_sweep(out, sweep_view(result.record))
        out.print(f"sweep: {escape(portable_path(result.html))} (also sweep.md, sweep.json)")
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command()
@friendly_errors
def gate(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by compare.", show_default=False)],
    thresholds: Annotated[
        Path, typer.Option("--thresholds", help="Checks (TOML), e.g. probes/gate-default.toml.", show_default=False)
    ],
    baseline: Annotated[Path | None, typer.Option(help="Run to compare against, for baseline_factor checks.")] = None,
    junit: Annotated[Path | None, typer.Option(help="Also write JUnit XML here (one testcase per check).")] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="Also write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
) -> None:
    """Check a run against thresholds: exit 0 when all pass (warnings allowed), 1 when a check fails,
    2 for a usage or configuration error (a missing, NaN or infinite value fails)."""
    result = _gate(run_dir, thresholds, baseline, quiet=as_json, junit=junit, markdown=markdown)
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    _gate_exit(result)


@app.command()
@friendly_errors
def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="Run directories written by compare; two or more are compared side by side.", show_default=False
        ),
    ],
    out_file: Annotated[
        Path | None,
        typer.Option(
            "--out", help="HTML file to write (default: <run>/report.html for one run, compare.html for several)."
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print what the pages show (the report's view model) as JSON; write nothing."),
    ] = False,
) -> None:
    """Render the report of a run again (figures, report.md, report.html), a sweep's pages from its
    sweep.json, or compare runs (grouped by GPU type); needs no engine and no GPU."""
    from mismatch_probe.report.html import write_report

    is_sweep = len(run_dirs) == 1 and out_file is None and (run_dirs[0] / "sweep.json").is_file()
    if as_json:
        sys.stdout.write(_report_json(run_dirs, is_sweep))
        return
    if is_sweep:
        from mismatch_probe.report.sweep import write_sweep_reports
        from mismatch_probe.sweep_record import read_sweep

        path = write_sweep_reports(run_dirs[0], read_sweep(run_dirs[0]))  # sweep.json is the source of truth
        out.print(f"sweep: {escape(str(path))}, sweep.md (the points' own reports: mismatch-probe report POINT_DIR)")
        return
    if len(run_dirs) == 1 and out_file is None:  # the run's own report, as compare writes it
        from mismatch_probe.pipeline import rerender

        t0 = time.perf_counter()
        path = rerender(run_dirs[0])
        size, seconds = path.stat().st_size, time.perf_counter() - t0
        out.print(
            f"report: {escape(str(path))} ({size / 1e6:.2f} MB, rendered in {seconds:.1f} s), report.md, figures/"
        )
        return
    written = write_report(run_dirs, out_file)
    what = f"comparison of {written.n_runs} runs" if written.n_runs > 1 else "report"
    out.print(
        f"{what}: {escape(str(written.path))} ({written.n_bytes / 1e6:.2f} MB, rendered in {written.seconds:.1f} s)"
    )


def _report_json(run_dirs: list[Path], is_sweep: bool) -> str:
    """The view model of a run, a sweep or a comparison of runs, as ``report --json`` prints it."""
    from mismatch_probe.report.data import load_run
    from mismatch_probe.report.model import comparison_view, label_runs, run_view

    if is_sweep:
        from mismatch_probe.report.sweep import sweep_view
        from mismatch_probe.sweep_record import read_sweep

        return sweep_view(read_sweep(run_dirs[0])).to_json()
    if len(run_dirs) == 1:
        run = load_run(run_dirs[0])
        return run_view(run.record, run.path, run.dist).to_json()
    return comparison_view(label_runs([load_run(d) for d in run_dirs])).to_json()


IMPORT_LABELS = {"engine.name": "engine", "engine.logprobs_mode": "engine log-probs"}


@app.command("import")
@friendly_errors
def import_(
    dump_format: Annotated[
        str, typer.Argument(metavar="FORMAT", help="slime, nemo-rl, verl or generic.", show_default=False)
    ],
    path: Annotated[Path, typer.Argument(help="The dump: a file, or the directory holding it.", show_default=False)],
    model: Annotated[Path, typer.Option(help="The checkpoint the run sampled with (local directory).")],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default reports/<format>-step<N>-<time>).")
    ] = None,
    step: Annotated[
        int | None, typer.Option(help="The step (rollout id) to import, when the dump holds several.")
    ] = None,
    engine: Annotated[
        str | None, typer.Option(help="The engine that sampled (recorded; default: the framework's usual one).")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="The run's sampling temperature (default: the dump's, else 1.0).")
    ] = None,
    top_p: Annotated[float | None, typer.Option(help="The run's top-p (default 1.0).")] = None,
    top_k: Annotated[int | None, typer.Option(help="The run's top-k (default 0: off).")] = None,
    engine_logprobs: Annotated[
        str | None,
        typer.Option(help="What the engine's log-probs are: raw (logits) or processed (after temperature...)."),
    ] = None,
    trainer_logprobs: Annotated[
        str | None,
        typer.Option(help="What the trainer's log-probs are: raw, temperature (logits / T) or processed."),
    ] = None,
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle", help="Read a pickled dump (verl's rollout cache), through an allow-list of its classes."
        ),
    ] = False,
    train_dump: Annotated[
        Path | None,
        typer.Option(
            help="slime: the train dump (--save-debug-train-data), when not train_data/ beside rollout_data/."
        ),
    ] = None,
    no_trainer: Annotated[
        bool, typer.Option("--no-trainer", help="Import the engine side only, even when the dump has the trainer's.")
    ] = False,
    shard_size: Annotated[int, typer.Option(help="Samples per shard (the unit of resume).")] = 256,
    settings: Annotated[
        list[str] | None,
        typer.Option("--set", help=SET_HELP + " Only \\[reference] and \\[corrections]: how `score` will re-score."),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out.")] = False,
) -> None:
    """Turn a training run's own rollout dump into a run directory: `analyze` it when the dump has the
    trainer's log-probs (what your run saw), `score` it to re-score the same tokens with the reference."""
    from mismatch_probe.importing import ImportOptions, import_dump

    options = ImportOptions(
        engine=engine,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        engine_logprobs=engine_logprobs,
        trainer_logprobs=trainer_logprobs,
        step=step,
        trust_pickle=trust_pickle,
        trainer_path=None if train_dump is None else str(train_dump),
        use_trainer=not no_trainer,
        shard_size=shard_size,
        overrides=parse_settings(settings),
    )
    with RichProgress(err) as progress:
        ctx = import_dump(dump_format, path, model=model, out=out_dir, options=options, progress=progress)
    info = ctx.record.imported_from or {}
    where = escape(portable_path(ctx.out))
    step_text = f" step {info['step']}" if info.get("step") is not None else ""
    out.print(
        f"imported {info.get('samples')} samples ({info.get('model_tokens')} model tokens) of the "
        f"{info.get('format')} dump{step_text} into {where}"
    )
    for note in info.get("notes") or []:
        out.print(f"note: {escape(note)}")
    sampled = ", ".join(
        f"{IMPORT_LABELS.get(key, key.partition('.')[2])} {ctx.record.lookup('spec.' + key)} ({source})"
        for key, source in (info.get("settings_from") or {}).items()
    )
    out.print(f"recorded as sampled with: {escape(sampled)}; flags set what the dump does not say")
    if info.get("trainer_logprobs"):
        out.print(f"next: mismatch-probe analyze {where}   (the engine against your trainer's own log-probs)")
        out.print(
            f"then: mismatch-probe score {where} --out {where}-reference --set reference.dtype=float32 "
            "--set reference.logits_fp32=true   (the same tokens against mismatch-probe's reference)"
        )
    else:
        out.print(f"next: mismatch-probe score {where}, then mismatch-probe analyze {where}")


@app.command()
@friendly_errors
def engines() -> None:
    """List the engines and whether each can run here."""
    from rich.table import Table

    from mismatch_probe.engines import registered_engines

    table = Table(title="engines")
    for col in ("name", "available", "description"):
        table.add_column(col)
    for name, entry in sorted(registered_engines().items()):
        missing = entry.missing()
        status = (
            "[green]yes[/]"
            if not missing
            else f"[red]no[/] (missing {', '.join(missing)}: {escape(entry.install_hint)})"
        )
        table.add_row(name, status, entry.description)
    out.print(table)


if __name__ == "__main__":
    app()
