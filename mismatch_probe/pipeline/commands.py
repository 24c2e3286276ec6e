"""The commands of the CLI as library functions, each named as its command and each a few stages
(:mod:`.stages`) on a run directory: ``compare`` is ``sample`` + ``score`` + ``analyze``, each of
which also runs alone, later or on another machine (``score`` and ``analyze`` need only the run
directory and the checkpoint); ``report`` renders a finished run again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.config.spec_reading import apply_overrides
from mismatch_probe.engines.base import Engine
from mismatch_probe.errors import ConfigError
from mismatch_probe.pipeline import stages
from mismatch_probe.pipeline.rollouts import adopt_rollouts
from mismatch_probe.pipeline.runs import (
    Progress,
    RunContext,
    RunResult,
    create_run,
    default_out_dir,
    open_run,
    require_shards,
)
from mismatch_probe.record import read_record
from mismatch_probe.table.tokens import ROLLOUTS_DIR, TOKENS_DIR


def compare(
    spec: ProbeSpec,
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
    engine: Engine | None = None,
    rollouts_from: str | Path | None = None,
) -> RunResult:
    """Run a probe end to end and return its run directory and record.

    The engine runs in a worker process started here and stopped before the reference loads.
    Pass ``engine`` (an adapter, or an :class:`EngineProcess` already started with the same engine
    settings) to reuse one engine across several runs; it is then left open for the caller.
    ``rollouts_from`` (a run with the same model, prompts, engine and sampling settings) skips
    the engine: its rollouts are scored as they are, so reference settings compare on the same tokens.
    """
    ctx = stages.prepare(spec, progress=progress, overwrite=overwrite, engine=engine, rollouts_from=rollouts_from)
    stages.sample(ctx, engine=engine, rollouts_from=rollouts_from)
    stages.score(ctx)
    dist = stages.analyze(ctx)
    stages.render(ctx, dist)
    return RunResult(ctx.out, ctx.record)


@dataclass
class VariantsResult:
    base_dir: Path
    runs: dict[str, RunResult]
    comparison: Path


def compare_variants(
    spec: ProbeSpec,
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
    rollouts_from: str | Path | None = None,
) -> VariantsResult:
    """A spec with ``[[variants]]``: the engine samples once, for the first variant (or not at all
    with ``rollouts_from``); every variant scores those same rollouts with its own reference
    settings (a run directory each, under the spec's ``out``); ``compare.html`` beside them puts
    the runs side by side."""
    from mismatch_probe.report.html import write_report

    progress = progress or Progress()
    spec.check_runnable()
    spec = spec.normalized()
    base = Path(spec.out) if spec.out else default_out_dir(spec)
    runs: dict[str, RunResult] = {}
    source = Path(rollouts_from) if rollouts_from else None
    for name, variant in spec.expand_variants(base):
        progress.log(f"variant {name}" + (f": scoring the rollouts of {source}" if source else ""))
        runs[name] = compare(variant, progress=progress, overwrite=overwrite, rollouts_from=source)
        source = source or runs[name].run_dir
    comparison = write_report([r.run_dir for r in runs.values()], base / "compare.html").path
    return VariantsResult(base, runs, comparison)


def sample(spec: ProbeSpec, *, progress: Progress | None = None, overwrite: bool = False) -> RunContext:
    """``mismatch-probe sample``: the engine only. The run directory then holds the rollouts and the
    engine's half of the record; :func:`score` and :func:`analyze` take it from there."""
    ctx = stages.prepare(spec, progress=progress, overwrite=overwrite)
    stages.sample(ctx)
    ctx.finish_invocation()  # the later stages add to its time
    return ctx


def score(
    run_dir: str | Path,
    *,
    out: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    model: str | Path | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> RunContext:
    """``mismatch-probe score``: the reference, on a sampled run. With ``out``, a new run directory
    that links ``run_dir``'s rollouts and scores them with other ``[reference]`` and ``[corrections]``
    settings: ``overrides`` (the flags; an error names the flag), then ``settings`` (``--set``);
    without, the missing token shards of ``run_dir`` itself.

    Under torchrun every rank calls this: the ranks join torchrun's process group and score as
    data-parallel groups (:mod:`mismatch_probe.reference.data_parallel`); rank 0 alone writes the record."""
    from mismatch_probe.reference.launch import torchrun_launch

    launch = torchrun_launch()
    source = open_run(run_dir, progress=progress, model=model)
    require_shards(source, ROLLOUTS_DIR, "rollout", f"mismatch-probe sample (its spec, --out {run_dir})")
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    settings = {k: v for k, v in (settings or {}).items() if v is not None}
    bad = [k for k in {**overrides, **settings} if k.partition(".")[0] not in ("reference", "corrections")]
    if bad:
        raise ConfigError(
            f"score sets {', '.join(bad)}: only [reference] and [corrections] settings score the same rollouts",
            hint="sample again with another spec for other settings",
        )
    spec = source.spec
    if out is not None:
        spec = apply_overrides(source.spec, overrides)
        spec = apply_overrides(spec, settings, named_by="set")
        spec = spec.model_copy(update={"out": str(out), "name": None}).normalized()
        if launch is None and spec.reference.sequence_parallel_size * spec.reference.tensor_parallel_size > 1:
            from mismatch_probe.reference.distributed import check_reference_layout

            check_reference_layout(source.model_path, spec.reference, trust_remote_code=spec.trust_remote_code)
    elif overrides or settings:
        raise ConfigError(
            "other reference settings score into a new run directory, next to this one",
            hint=f"add --out NEW_DIR (it links the rollouts of {run_dir})",
        )
    elif source.record.reference is not None and source.record.reference.to_dict().get("source") == "trainer":
        raise ConfigError(
            f"{run_dir} holds its trainer's log-probs from an imported dump in the reference's place; "
            "scoring with mismatch-probe's reference makes a new run directory beside it",
            hint=f"add --out NEW_DIR (it links the rollouts of {run_dir}; the trainer's log-probs stay in its table)",
        )
    if launch is not None:
        return _score_launched(source, spec, launch, out, model=model, overwrite=overwrite)
    ctx = source if out is None else derive_run(source, spec, Path(out), overwrite=overwrite)
    stages.score(ctx)
    ctx.finish_invocation()
    return ctx


def _score_launched(
    source: RunContext, spec: ProbeSpec, launch, out: str | Path | None, *, model, overwrite: bool
) -> RunContext:
    """:func:`score` on one rank of a torchrun launch."""
    import torch.distributed as dist

    from mismatch_probe.modeling.loading import resolve_device
    from mismatch_probe.reference.data_parallel import score_data_parallel
    from mismatch_probe.reference.distributed import check_reference_layout
    from mismatch_probe.reference.launch import data_parallel_size, join, on_lead

    check_reference_layout(source.model_path, spec.reference, trust_remote_code=spec.trust_remote_code, gpus=False)
    data_parallel_size(launch.world_size, spec.reference.sequence_parallel_size, spec.reference.tensor_parallel_size)
    join(launch, resolve_device(spec.reference.device))
    try:
        ctx = source
        if out is not None:  # rank 0 makes the new run directory; the others then open it
            made: list[RunContext] = []
            on_lead(lambda: made.append(derive_run(source, spec, Path(out), overwrite=overwrite)))
            ctx = made[0] if made else open_run(out, progress=source.progress, model=model)
        score_data_parallel(ctx, launch, stages.reference_semantics(ctx))
        if launch.is_lead:
            ctx.finish_invocation()
        return ctx
    finally:
        dist.destroy_process_group()


def derive_run(source: RunContext, spec: ProbeSpec, out: Path, *, overwrite: bool) -> RunContext:
    """A new run directory scoring ``source``'s rollouts with ``spec`` (its reference settings):
    the rollouts are linked, and the fingerprints are by the sampled run's rules (its rollout
    fingerprint is that run's)."""
    ctx = create_run(
        spec,
        out,
        model_path=source.model_path,
        shards=source.shards,
        overwrite=overwrite,
        progress=source.progress,
        fingerprint_schema=source.record.fingerprint_schema,
        rollout_fingerprint=source.record.rollout_fingerprint,
        inputs=source.record.inputs.to_dict() if source.record.inputs is not None else {},
    )
    ctx._tokenizer = source._tokenizer
    adopt_rollouts(spec, source.out, ctx.record, len(ctx.shards), out / ROLLOUTS_DIR, check=False)
    ctx.save()
    return ctx


def analyze(run_dir: str | Path, *, progress: Progress | None = None, model: str | Path | None = None) -> RunResult:
    """``mismatch-probe analyze``: metrics, sequences and the report of a scored run."""
    ctx = open_run(run_dir, progress=progress, model=model)
    require_shards(ctx, ROLLOUTS_DIR, "rollout", f"mismatch-probe sample (its spec, --out {run_dir})")
    require_shards(ctx, TOKENS_DIR, "scored token", f"mismatch-probe score {run_dir}")
    dist = stages.analyze(ctx)
    stages.render(ctx, dist)
    return RunResult(ctx.out, ctx.record)


def report(run_dir: str | Path, *, framework: str | None = None) -> Path:
    """``mismatch-probe report RUN``: a finished run's figures, report.md and report.html rendered
    again from its directory, as the render stage does; returns report.html's path. ``framework``
    names the RL framework whose dashboard the report shows (recorded as the spec's
    ``[stack].framework``, which no fingerprint holds)."""
    from mismatch_probe.report.pages import render_again

    if framework is not None:
        from mismatch_probe.analysis.peer_metrics import frameworks

        if framework not in frameworks():
            raise ConfigError(f"--framework {framework!r} has no dashboard", hint=f"one of {', '.join(frameworks())}")
        record = read_record(run_dir)
        record.spec.stack = {**(record.spec.stack or {}), "framework": framework}
        record.write(Path(run_dir))
    return render_again(run_dir)
