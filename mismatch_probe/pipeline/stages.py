"""The stages of a run: prepare -> sample -> score -> analyze -> render.

Each takes the run's :class:`~mismatch_probe.pipeline.runs.RunContext` and persists its output
before the next starts, so each can run alone (``mismatch-probe sample``, ``score``, ``analyze``,
``report``: :mod:`.commands`) and a killed run resumes where it stopped:

1. :func:`prepare`: every input checked, then the run directory created (or resumed);
2. :func:`sample`: for each missing rollout shard, the engine samples it and re-scores it with its
   own prefill (the engine runs in a worker process, started only if a shard is missing and stopped
   before the reference loads, so its memory is free again) -> ``rollouts/``;
3. :func:`score`: for each missing token shard, the reference scores the exact same ids -> ``tokens.parquet/``;
4. :func:`analyze`: metrics, per-sequence terms and the report's distributions in one streaming
   pass over the token shards -> ``run.json`` (complete), ``sequences.parquet``, ``distributions.json``;
5. :func:`render`: figures, ``report.md`` and ``report.html`` from the in-memory record.

run.json is rewritten at each stage with ``status`` ``running``/``complete``, so an interrupted run
says how far it got, and a re-run with the same spec (same fingerprint) picks up from there.
See ARCHITECTURE.md, "Stages".
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mismatch_probe.analysis.analyze import analyze as analyze_tokens
from mismatch_probe.analysis.distributions import (
    DISTRIBUTIONS_JSON,
    DistributionAccumulator,
    with_sequences,
    worst_sequences,
)
from mismatch_probe.analysis.distributions import save as save_distributions
from mismatch_probe.analysis.intervals import run_intervals
from mismatch_probe.analysis.samples import sample_summary
from mismatch_probe.analysis.sequences import SequenceCollector, group_columns
from mismatch_probe.config.spec import PERTURBED, ProbeSpec
from mismatch_probe.engines.base import Engine
from mismatch_probe.errors import ConfigError, DataError, ProbeError
from mismatch_probe.files import portable_path, resolve_from_dir
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.pipeline import adaptive
from mismatch_probe.pipeline.rollouts import adopt_rollouts, sample_shards
from mismatch_probe.pipeline.runs import (
    ENGINE_LOG,
    REFERENCE_LOG,
    Progress,
    RolloutInputs,
    RunContext,
    create_run,
    default_out_dir,
    shard_samples,
    timed,
)
from mismatch_probe.record import SEQUENCES_PARQUET, find_record, now
from mismatch_probe.table.tokens import (
    RECEIVED_DIR,
    ROLLOUTS_DIR,
    TOKENS_DIR,
    read_rollout_shard,
    shard_name,
    token_table,
    write_sequences,
    write_table_atomic,
)


def prepare(
    spec: ProbeSpec,
    *,
    progress: Progress | None = None,
    overwrite: bool = False,
    engine: Engine | None = None,
    rollouts_from: str | Path | None = None,
) -> RunContext:
    """Check every input before anything is written, then create (or resume) the run directory."""
    from mismatch_probe.engines import get_entry
    from mismatch_probe.modeling.architecture import describe_checkpoint
    from mismatch_probe.modeling.loading import (
        check_engine_checkpoint,
        check_model_dir,
        check_sync_start,
        checkpoint_quantization,
        load_tokenizer,
        max_model_len,
        stop_token_ids,
    )
    from mismatch_probe.reference.launch import torchrun_launch
    from mismatch_probe.rollout.prompts import tokenize_prompts

    t_start = time.perf_counter()
    if spec.sweep is not None:
        raise ConfigError("the spec has a [sweep] table", hint="run it with `mismatch-probe sweep SPEC`")
    if (launch := torchrun_launch()) is not None and launch.world_size > 1:
        raise ConfigError(
            f"torchrun started {launch.world_size} copies of a command that runs the engine (which starts its own "
            "processes): only `score` runs under torchrun",
            hint="run `mismatch-probe sample` once, then `torchrun ... mismatch-probe score RUN_DIR`",
        )
    spec.check_runnable()
    adaptive.check_adaptive(spec)
    spec = spec.normalized()
    if rollouts_from is not None and (theirs := find_record(Path(rollouts_from))) and theirs.imported_from:
        # its spec is the dump's, which no probe spec reproduces: score re-scores it as it is
        raise ConfigError(
            f"--rollouts-from {rollouts_from} was imported from a {theirs.imported_from.get('format')} dump",
            hint=f"score its rollouts with `mismatch-probe score {rollouts_from} --out NEW_DIR --set reference.KEY=VALUE`",
        )
    model_path = check_model_dir(str(spec.model))
    entry = get_entry(spec.engine.name)
    entry.check_settings(spec.engine)
    if engine is None and rollouts_from is None and spec.engine.python is None and (missing_pkgs := entry.missing()):
        # fail before any work; with --engine-python the worker's own interpreter is what matters
        raise ConfigError(
            f"engine {entry.name!r} needs {', '.join(missing_pkgs)}, which is not installed here",
            hint=entry.install_hint,
        )
    if spec.reference.sequence_parallel_size * spec.reference.tensor_parallel_size > 1:
        from mismatch_probe.reference.distributed import check_reference_layout

        check_reference_layout(model_path, spec.reference, trust_remote_code=spec.trust_remote_code)
    tokenizer = load_tokenizer(model_path, trust_remote_code=spec.trust_remote_code)
    if (spec.engine.checkpoint or spec.engine.quantization) and spec.sync.enabled:
        # the engine starts from sync.start_from; a quantized engine takes synced weights either
        # quantized by the trainer (a compressed-tensors export's int8/fp8 tensors and scales) or
        # as bf16 that it re-quantizes (online fp8): neither path is probed yet (issue 38, item 5)
        which = "engine.checkpoint" if spec.engine.checkpoint else f"engine.quantization = {spec.engine.quantization!r}"
        raise ConfigError(
            f"{which} and [sync] together: syncing into a quantized engine is not probed yet (the synced "
            "engine starts from sync.start_from, and its re-quantization and scales are not checked)",
            hint=f"drop {which.split(' ')[0]} or [sync]",
        )
    if spec.sync.start_from not in (None, PERTURBED):
        check_sync_start(spec.sync.start_from, model_path)
    engine_checkpoint = (
        check_engine_checkpoint(spec.engine.checkpoint, model_path, tokenizer, trust_remote_code=spec.trust_remote_code)
        if spec.engine.checkpoint
        else None
    )
    model_len = max_model_len(model_path, tokenizer)
    prompts = tokenize_prompts(
        str(spec.prompts),
        tokenizer,
        max_prompts=spec.max_prompts,
        max_model_len=model_len,
        max_new_tokens=spec.sampling.max_tokens,
    )
    stops = stop_token_ids(model_path, tokenizer)
    n_samples = len(prompts) * spec.sampling.n
    shards = shard_samples(n_samples, spec.sampling.n, spec.shard_size)
    # only now, with the inputs checked, does the run directory appear
    ctx = create_run(
        spec,
        Path(spec.out) if spec.out else default_out_dir(spec),
        model_path=model_path,
        shards=shards,
        overwrite=overwrite,
        progress=progress,
        t_start=t_start,
        inputs={
            # relative to the working directory when under it: no machine's absolute paths in a record
            "model": portable_path(model_path),
            "prompts": portable_path(str(spec.prompts)),
            "n_prompts": len(prompts),
            "n_samples": n_samples,
            "n_shards": len(shards),
            "stop_token_ids": stops,
            **(
                {
                    "engine_checkpoint": portable_path(engine_checkpoint),
                    "engine_checkpoint_quantization": checkpoint_quantization(engine_checkpoint),
                }
                if engine_checkpoint is not None
                else {}
            ),
        },
        architecture=describe_checkpoint(model_path, trust_remote_code=spec.trust_remote_code),
        # setup: checks, library imports, tokenizer, prompts, fingerprint
        timings={"setup_s": round(time.perf_counter() - t_start, 3)},
    )
    ctx.inputs = RolloutInputs(entry, prompts, stops, model_len)
    ctx._tokenizer = tokenizer
    if adaptive.is_adaptive(spec):
        source = rollouts_from or (
            resolve_from_dir(ctx.out, ctx.earlier_rollouts_from) if ctx.earlier_rollouts_from else None
        )
        theirs = find_record(Path(source)) if source is not None else None  # adopted: their rounds
        adaptive.plan_rounds(ctx, theirs.inputs.round_samples if theirs is not None and theirs.inputs else None)
        ctx.save()
    return ctx


def sample(ctx: RunContext, *, engine: Engine | None = None, rollouts_from: str | Path | None = None) -> None:
    """The missing rollout shards, from the engine (or adopted from another run)."""
    spec, out, record = ctx.spec, ctx.out, ctx.record
    rollout_dir, token_dir = out / ROLLOUTS_DIR, out / TOKENS_DIR
    if rollouts_from is None and ctx.earlier_rollouts_from:
        rollouts_from = resolve_from_dir(out, ctx.earlier_rollouts_from)  # recorded relative to this run directory
    if rollouts_from is not None:
        adopt_rollouts(spec, Path(rollouts_from), record, len(ctx.shards), rollout_dir)
        ctx.save()
    if ctx.resuming:  # timings then cover this invocation only; say what it reused
        record.resumed = {
            "rollout_shards_reused": sum((rollout_dir / shard_name(i)).is_file() for i in range(len(ctx.shards))),
            "token_shards_reused": sum((token_dir / shard_name(i)).is_file() for i in range(len(ctx.shards))),
        }
    missing = ctx.missing(ROLLOUTS_DIR)
    if spec.sync.enabled and rollouts_from is None:
        _sample_synced(ctx, missing)
        return
    in_rounds = adaptive.is_adaptive(spec) and rollouts_from is None
    if not missing and not (in_rounds and not adaptive.finished(ctx)):
        # a run stopped right after its last shard may have left a remote engine's answers
        shutil.rmtree(rollout_dir / RECEIVED_DIR, ignore_errors=True)
        return
    if ctx.inputs is None and not in_rounds:
        raise ConfigError(
            f"{out} lacks rollout shards", hint=f"sample them with its spec: mismatch-probe sample SPEC --out {out}"
        )
    process = None  # the engine worker started here (None: the caller's engine, left open for it)

    def started() -> Engine:
        """The engine, started here the first time a shard needs it."""
        nonlocal engine, process
        if engine is None:
            from mismatch_probe.engines.process import EngineProcess

            if ctx.inputs is None:
                raise ConfigError(
                    f"{out} lacks rollout shards",
                    hint=f"sample them with its spec: mismatch-probe sample SPEC --out {out}",
                )
            entry = ctx.inputs.entry
            ctx.progress.log(f"starting engine {entry.name} (log: {portable_path(out / ENGINE_LOG)})")
            with timed(ctx.timings, "engine_start_s"):
                engine = process = EngineProcess(
                    entry,
                    ctx.model_path,
                    spec.engine,
                    log_path=out / ENGINE_LOG,
                    trust_remote_code=spec.trust_remote_code,
                    state_dir=rollout_dir / RECEIVED_DIR,
                )
        return engine

    try:
        try:
            if in_rounds:  # the reference scores each round beside the engine, which stays up between rounds
                adaptive.sample_in_rounds(ctx, started, sample_shards, opened_reference)
            else:
                sample_shards(ctx, started(), missing)
        finally:
            if process is not None:
                with timed(ctx.timings, "engine_stop_s"):
                    process.close()  # returns once the worker, and the memory it held, is gone
                record.engine_process = process.describe()
    except BaseException as exc:
        ctx.fail(exc)
        raise
    # every shard is written: the answers a remote engine kept for a resume are in them now
    shutil.rmtree(rollout_dir / RECEIVED_DIR, ignore_errors=True)


def _sample_synced(ctx: RunContext, missing: list[int]) -> None:
    """The sample stage of a run with [sync]: its engines are its own (``pipeline/sync.py``), a
    caller's shared engine holds other weights."""
    from mismatch_probe.pipeline import sync

    if not missing and not sync.sync_incomplete(ctx):
        return
    if ctx.inputs is None:
        raise ConfigError(
            f"{ctx.out} lacks rollout shards",
            hint=f"sample them with its spec: mismatch-probe sample SPEC --out {ctx.out}",
        )
    if sync.sync_incomplete(ctx) and len(missing) < len(ctx.shards):
        sync.restart_sample_stage(ctx)  # the engine that held the sync's state is gone
        missing = ctx.missing(ROLLOUTS_DIR)
    try:
        sync.sample_synced(ctx, missing, sample_shards)
    except BaseException as exc:
        ctx.fail(exc)
        raise
    shutil.rmtree(ctx.out / ROLLOUTS_DIR / RECEIVED_DIR, ignore_errors=True)


def score(ctx: RunContext) -> None:
    """The reference scores the missing token shards, the exact ids the engine sampled."""
    missing = ctx.missing(TOKENS_DIR)
    if not missing:
        return
    with opened_reference(ctx) as reference:
        ctx.progress.stage("score", sum(len(ctx.shards[i]) for i in missing))
        for i in missing:
            reference.score_shard(i)


class ReferenceScoring:
    """The reference, loaded, scoring a run's shards one at a time: :func:`score` all the missing ones
    at once, an adaptive run's rounds (``pipeline/adaptive.py``) each round's as it is sampled."""

    def __init__(self, ctx: RunContext, scorer: Any, replay: Any) -> None:
        routing = ctx.record.engine.routing if ctx.record.engine is not None else None
        self.ctx, self.scorer = ctx, scorer
        self.semantics = reference_semantics(ctx)
        self.width = (len(routing.moe_layers), routing.top_k) if routing else None
        self.options = {"replay": True} if replay is True else {}  # only the in-process scorer takes it

    def score_shard(self, i: int) -> None:
        ctx = self.ctx
        with timed(ctx.timings, "scoring_s"):
            rollouts = read_rollout_shard(ctx.out / ROLLOUTS_DIR / shard_name(i), self.width)
            scores = self.scorer.score(
                rollouts, self.semantics, on_progress=lambda k: ctx.progress.advance("score", k), **self.options
            )
            trainer = [r.logp_trainer for r in rollouts]  # an imported dump's, kept beside ours
            table = token_table(
                rollouts, scores.logp, scores.entropy, scores.experts, trainer, logp_replay=scores.logp_replay
            )
            write_table_atomic(table, ctx.out / TOKENS_DIR / shard_name(i))


@contextmanager
def opened_reference(ctx: RunContext) -> Iterator[ReferenceScoring]:
    """The run's reference, loaded (its load timed, what it is recorded) until the block ends; then its
    peak memory is recorded and it is closed."""
    from mismatch_probe.reference import open_reference_scorer
    from mismatch_probe.reference.scorer import replay_info, routing_replay

    record = ctx.record
    reference_semantics(ctx)  # a run whose record lacks the semantics fails before the load
    with timed(ctx.timings, "reference_load_s"):
        scorer = open_reference_scorer(
            ctx.model_path,
            ctx.spec.reference,
            trust_remote_code=ctx.spec.trust_remote_code,
            log_path=ctx.out / REFERENCE_LOG,
        )
    try:
        routing = record.engine.routing if record.engine is not None else None
        replay = routing_replay(ctx.spec.reference.routing_replay, scorer) if routing else None
        record.update_sections({"reference": scorer.info() | replay_info(replay)})
        ctx.save()
        yield ReferenceScoring(ctx, scorer, replay)
        info, peaks = scorer.info() | replay_info(replay), scorer.peak_memory()
        if "parallel" in info:
            info["parallel"]["peak_memory_per_rank"] = peaks
        else:
            info["peak_memory"] = peaks[0]
        record.update_sections({"reference": info})
        ctx.save()
    finally:
        scorer.close()


def reference_semantics(ctx: RunContext) -> LogprobSemantics:
    """The distribution the reference scores under, as the sample stage recorded it."""
    semantics_record = ctx.record.logprob_semantics
    if semantics_record is None or semantics_record.reference is None:
        raise ConfigError(
            f"{ctx.out} has rollouts but its run.json does not say what their log-probs are",
            hint="re-run with --overwrite",
        )
    return LogprobSemantics.from_record(semantics_record.reference.to_dict())


def analyze(ctx: RunContext) -> dict:
    """Metrics, per-sequence terms and distributions in one pass; the record is complete.
    Returns the distributions (what the report draws)."""
    out, record = ctx.out, ctx.record
    routing = record.engine.routing if record.engine is not None else None
    with timed(ctx.timings, "metrics_s"):
        try:
            distributions, sequences = DistributionAccumulator(), SequenceCollector()
            sections = analyze_tokens(
                out, ctx.spec.corrections, routing.to_dict() if routing else None, distributions, sequences
            )
        except DataError as exc:
            ctx.fail(exc)
            raise DataError(f"{exc}; the per-token table is kept in {out / TOKENS_DIR}") from None
    if sections.get("decode_vs_prefill") is None:
        sections["decode_vs_prefill"] = record.decode_vs_prefill or None
    sections["samples"] = sample_summary(out)
    if ctx.spec.sync.enabled and record.sync is not None:
        from mismatch_probe.pipeline.sync import analyze_sync

        with timed(ctx.timings, "metrics_s"):
            sections["sync"] = analyze_sync(ctx)
    with timed(ctx.timings, "metrics_s"):
        write_sequences(out, sequences.table)
        # the run's own sampling noise: which sequences it happened to sample (the report's next steps and
        # suggested gate read it)
        sections["intervals"] = run_intervals(group_columns(sequences.table, "all"))
        dist = distributions.result
        assert dist is not None  # the pass above finished it
        dist["worst_sequences"] = worst_sequences(out, dist["worst"], ctx.tokenizer)
        save_distributions(out, dist)  # token level; the sequence level is sequences.parquet
        dist = with_sequences(dist, sequences.table)
    record.update_sections(
        sections | {"distributions": DISTRIBUTIONS_JSON, "sequences": SEQUENCES_PARQUET, "status": "complete"}
    )
    record.completed_at = now()
    ctx.finish_invocation()
    return dist


def render(ctx: RunContext, dist: dict) -> None:
    """Figures, report.md and report.html, rendered once from the in-memory record (what
    ``mismatch-probe report`` renders from run.json). A failure here keeps the complete run."""
    from mismatch_probe.report.figures import run_figures
    from mismatch_probe.report.pages import write_figure_files, write_run_pages

    out, record = ctx.out, ctx.record
    try:
        with timed(ctx.timings, "figures_s"):
            figures = run_figures(record, dist)
            record.update_sections({"figures": write_figure_files(out, figures)})
        # the pages show the run's timings up to here; report_s (rendering them) goes to run.json only
        ctx.timings["total_s"] = round(time.perf_counter() - ctx.t_start, 3)
        with timed(ctx.timings, "report_s"):
            write_run_pages(out, record, dist, figures)
    except Exception as exc:  # the run itself is complete on disk; only its rendering failed
        if isinstance(exc, ProbeError):
            raise
        raise ProbeError(
            f"the run is complete in {out}, but rendering its report failed: {type(exc).__name__}: {exc}",
            hint=f"re-render it with `mismatch-probe report {out}`; --debug shows the traceback",
        ) from exc
    ctx.save()
