"""``compare`` as stages over one run directory: sample -> score -> analyze -> render.

:func:`run_compare` prepares a :class:`RunContext` (the checked inputs, the run directory and its
:class:`~mismatch_probe.record.RunRecord`) and runs the stages on it; each persists its output, so
each can be re-run alone and a killed run resumes where it stopped:

1. :func:`sample`: for each missing rollout shard, the engine samples it and re-scores it with its
   own prefill (the engine runs in a worker process, started only if a shard is missing and stopped
   before the reference loads, so its memory is free again) -> ``rollouts/``;
2. :func:`score`: for each missing token shard, the reference scores the exact same ids -> ``tokens.parquet/``;
3. :func:`analyze_run`: metrics, per-sequence terms and the report's distributions in one streaming
   pass over the token shards -> ``run.json`` (complete), ``sequences.parquet``, ``distributions.json``;
4. :func:`render`: figures, ``report.md`` and ``report.html`` from the in-memory record.

run.json is rewritten at each stage with ``status`` ``running``/``complete``, so an interrupted run
says how far it got, and a re-run with the same spec (same fingerprint) picks up from there.
See ARCHITECTURE.md, "Stages".
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch_probe import __version__
from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.analysis.distributions import (
    DISTRIBUTIONS_JSON,
    DistributionAccumulator,
    with_sequences,
    worst_sequences,
)
from mismatch_probe.analysis.distributions import save as save_distributions
from mismatch_probe.analysis.sequences import SequenceCollector
from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.engines.base import Engine
from mismatch_probe.errors import ConfigError, DataError, ProbeError
from mismatch_probe.files import atomic_path, portable_path, relative_to_dir, resolve_from_dir, write_atomic
from mismatch_probe.modeling.logprobs import LogprobSemantics, reference_semantics
from mismatch_probe.record import (
    SCHEMA_VERSION,
    SEQUENCES_PARQUET,
    RunRecord,
    find_record,
    json_safe,
    now,
    parse_record,
    read_record,
)
from mismatch_probe.table.tokens import (
    RECEIVED_DIR,
    ROLLOUTS_DIR,
    TOKENS_DIR,
    Rollout,
    read_rollout_shard,
    rollouts_to_table,
    shard_name,
    token_table,
    write_sequences,
    write_table_atomic,
)

if TYPE_CHECKING:
    from mismatch_probe.report.figures import DrawnFigure

REPORT_MD = "report.md"
ENGINE_LOG = "engine.log"
REFERENCE_LOG = "reference.log"  # what the reference's rank processes print (sequence/tensor parallel)
# sections a resumed run keeps from its earlier invocation until a stage that reruns sets them again
CARRIED_SECTIONS = (
    "engine",
    "engine_process",
    "reference",
    "logprob_semantics",
    "decode_vs_prefill",
    "tokenization_check",
)


class Progress:
    """Progress sink; the CLI plugs in rich bars, the library default does nothing."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str, amount: int) -> None: ...

    def log(self, message: str) -> None: ...


@dataclass
class RunResult:
    run_dir: Path
    run: RunRecord

    @property
    def record(self) -> dict[str, Any]:
        """The record as run.json stores it (strict JSON: infinities as strings), for scripts."""
        return json_safe(self.run.to_dict())


@dataclass
class _Sample:
    sample_id: int
    prompt_index: int


@dataclass
class RunContext:
    """What the stages of one run share: the checked spec and inputs, the run directory, the record."""

    spec: ProbeSpec
    out: Path
    record: RunRecord
    progress: Progress
    entry: Any  # engines.EngineEntry
    model_path: Path
    tokenizer: Any
    model_len: int
    prompts: list
    stops: list[int]
    shards: list[list[_Sample]]
    t_start: float
    resuming: bool = False  # a run directory with an earlier invocation's record
    earlier_rollouts_from: str | None = None  # the run it adopted rollouts from, relative to ``out``

    @property
    def timings(self) -> dict[str, float]:
        return self.record.timings

    def save(self) -> None:
        self.record.write(self.out)

    def missing(self, directory: str) -> list[int]:
        d = self.out / directory
        return [i for i in range(len(self.shards)) if not (d / shard_name(i)).is_file()]

    def fail(self, exc: BaseException) -> None:
        """Record why the run stopped (it resumes from what is on disk)."""
        self.record.stopped_by(exc)
        self.save()


def default_out_dir(spec: ProbeSpec) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = spec.name or f"{Path(spec.model).name}-{spec.engine.name}"
    return Path("reports") / f"{name}-{stamp}"


def prepare_run_dir(spec: ProbeSpec, out: Path, *, overwrite: bool) -> RunRecord | None:
    """Create ``out`` or check it can be resumed; returns the previous record when resuming."""
    fingerprint = spec.fingerprint()
    return prepare_out_dir(
        out,
        lambda previous: previous.spec_fingerprint == fingerprint,
        "a run with a different spec",
        overwrite=overwrite,
    )


def prepare_out_dir(
    out: Path, same_run: Callable[[RunRecord], bool], other: str, *, overwrite: bool
) -> RunRecord | None:
    """Create ``out``, or check that the run in it is the one ``same_run`` recognises (and return
    its record, to resume it); ``other`` says what it holds when it is not."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        try:
            previous = find_record(out)
        except ConfigError:  # not JSON, or not a record this version reads
            previous = None
        if previous is None:
            # never delete a directory that is not a run, even with --overwrite
            raise ConfigError(f"--out {str(out)!r} is not empty and holds no run", hint="choose another --out")
        if overwrite:
            shutil.rmtree(out)
        elif not same_run(previous):
            raise ConfigError(
                f"--out {str(out)!r} holds {other}",
                hint="use another --out, or --overwrite to replace it",
            )
        else:
            return previous
    out.mkdir(parents=True, exist_ok=True)
    return None


@contextmanager
def _timed(timings: dict, key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = round(timings.get(key, 0.0) + time.perf_counter() - t0, 3)


def run_compare(
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
    ctx = prepare(spec, progress=progress, overwrite=overwrite, engine=engine, rollouts_from=rollouts_from)
    sample(ctx, engine=engine, rollouts_from=rollouts_from)
    score(ctx)
    dist = analyze_run(ctx)
    render(ctx, dist)
    return RunResult(ctx.out, ctx.record)


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
    from mismatch_probe.environment import fingerprint
    from mismatch_probe.modeling.architecture import describe_checkpoint
    from mismatch_probe.modeling.loading import check_model_dir, load_tokenizer, max_model_len, stop_token_ids
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
    spec.validate()
    if rollouts_from is not None and (theirs := find_record(Path(rollouts_from))) and theirs.imported_from:
        # its spec is the dump's, which no probe spec reproduces: score re-scores it as it is
        raise ConfigError(
            f"--rollouts-from {rollouts_from} was imported from a {theirs.imported_from.get('format')} dump",
            hint=f"score its rollouts with `mismatch-probe score {rollouts_from} --out NEW_DIR --set reference.KEY=VALUE`",
        )
    model_path = check_model_dir(spec.model)
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
    model_len = max_model_len(model_path, tokenizer)
    prompts = tokenize_prompts(
        spec.prompts,
        tokenizer,
        max_prompts=spec.max_prompts,
        max_model_len=model_len,
        max_new_tokens=spec.sampling.max_tokens,
    )
    stops = stop_token_ids(model_path, tokenizer)
    # only now, with the inputs checked, does the run directory appear
    out = Path(spec.out) if spec.out else default_out_dir(spec)
    previous = prepare_run_dir(spec, out, overwrite=overwrite)
    environment = fingerprint()
    samples = [_Sample(p * spec.sampling.n + j, p) for p in range(len(prompts)) for j in range(spec.sampling.n)]
    shards = [samples[i : i + spec.shard_size] for i in range(0, len(samples), spec.shard_size)]
    record = parse_record(
        {
            "schema_version": SCHEMA_VERSION,
            "probe_version": __version__,
            "status": "running",
            "created_at": previous.created_at if previous is not None and previous.created_at else now(),
            "spec": spec.to_dict(),
            "spec_file": spec.given_paths.get("spec_file"),
            "spec_fingerprint": spec.fingerprint(),
            "rollout_fingerprint": spec.rollout_fingerprint(),
            "environment": environment,
            "inputs": {
                # relative to the working directory when under it: no machine's absolute paths in a record
                "model": portable_path(model_path),
                "prompts": portable_path(spec.prompts),
                "n_prompts": len(prompts),
                "n_samples": len(samples),
                "n_shards": len(shards),
                "stop_token_ids": stops,
            },
            "architecture": describe_checkpoint(model_path, trust_remote_code=spec.trust_remote_code),
            # what an earlier invocation learned about its engine and reference (None on a fresh run)
            **{key: getattr(previous, key, None) for key in CARRIED_SECTIONS},
            # setup: checks, library imports, tokenizer, prompts, fingerprint
            "timings": {"setup_s": round(time.perf_counter() - t_start, 3)},
        }
    )
    ctx = RunContext(
        spec=spec,
        out=out,
        record=record,
        progress=progress or Progress(),
        entry=entry,
        model_path=model_path,
        tokenizer=tokenizer,
        model_len=model_len,
        prompts=prompts,
        stops=stops,
        shards=shards,
        t_start=t_start,
        resuming=previous is not None,
        earlier_rollouts_from=(previous.rollouts_from or {}).get("run") if previous is not None else None,
    )
    ctx.save()
    return ctx


def sample(ctx: RunContext, *, engine: Engine | None = None, rollouts_from: str | Path | None = None) -> None:
    """Stage 1: the missing rollout shards, from the engine (or adopted from another run)."""
    spec, out, record = ctx.spec, ctx.out, ctx.record
    rollout_dir, token_dir = out / ROLLOUTS_DIR, out / TOKENS_DIR
    if rollouts_from is None and ctx.earlier_rollouts_from:
        rollouts_from = resolve_from_dir(out, ctx.earlier_rollouts_from)  # recorded relative to this run directory
    if rollouts_from is not None:
        _adopt_rollouts(spec, Path(rollouts_from), record, len(ctx.shards), rollout_dir)
        ctx.save()
    if ctx.resuming:  # timings then cover this invocation only; say what it reused
        record.resumed = {
            "rollout_shards_reused": sum((rollout_dir / shard_name(i)).is_file() for i in range(len(ctx.shards))),
            "token_shards_reused": sum((token_dir / shard_name(i)).is_file() for i in range(len(ctx.shards))),
        }
    missing = ctx.missing(ROLLOUTS_DIR)
    if not missing:
        # a run stopped right after its last shard may have left a remote engine's answers
        shutil.rmtree(rollout_dir / RECEIVED_DIR, ignore_errors=True)
        return
    owned = engine is None
    try:
        if owned:
            from mismatch_probe.engines.process import EngineProcess

            ctx.progress.log(f"starting engine {ctx.entry.name} (log: {portable_path(out / ENGINE_LOG)})")
            with _timed(ctx.timings, "engine_start_s"):
                engine = EngineProcess(
                    ctx.entry,
                    ctx.model_path,
                    spec.engine,
                    log_path=out / ENGINE_LOG,
                    trust_remote_code=spec.trust_remote_code,
                    state_dir=rollout_dir / RECEIVED_DIR,
                )
        try:
            _rollouts(ctx, engine, missing)
        finally:
            if owned:
                with _timed(ctx.timings, "engine_stop_s"):
                    engine.close()  # returns once the worker, and the memory it held, is gone
                record.engine_process = engine.describe()
    except BaseException as exc:
        ctx.fail(exc)
        raise
    # every shard is written: the answers a remote engine kept for a resume are in them now
    shutil.rmtree(rollout_dir / RECEIVED_DIR, ignore_errors=True)


def score(ctx: RunContext) -> None:
    """Stage 2: the reference scores the missing token shards, the exact ids the engine sampled."""
    from mismatch_probe.reference import open_reference_scorer

    missing = ctx.missing(TOKENS_DIR)
    if not missing:
        return
    out, record, progress = ctx.out, ctx.record, ctx.progress
    semantics = _reference_semantics(ctx)
    with _timed(ctx.timings, "reference_load_s"):
        scorer = open_reference_scorer(
            ctx.model_path,
            ctx.spec.reference,
            trust_remote_code=ctx.spec.trust_remote_code,
            log_path=out / REFERENCE_LOG,
        )
    try:
        record.update_sections({"reference": scorer.info()})
        ctx.save()
        routing = record.engine.routing if record.engine is not None else None
        width = (len(routing.moe_layers), routing.top_k) if routing else None
        progress.stage("score", sum(len(ctx.shards[i]) for i in missing))
        with _timed(ctx.timings, "scoring_s"):
            for i in missing:
                rollouts = read_rollout_shard(out / ROLLOUTS_DIR / shard_name(i), width)
                scores = scorer.score(rollouts, semantics, on_progress=lambda k: progress.advance("score", k))
                trainer = [r.logp_trainer for r in rollouts]  # an imported dump's, kept beside ours
                table = token_table(rollouts, scores.logp, scores.entropy, scores.experts, trainer)
                write_table_atomic(table, out / TOKENS_DIR / shard_name(i))
        info, peaks = scorer.info(), scorer.peak_memory()
        if "parallel" in info:
            info["parallel"]["peak_memory_per_rank"] = peaks
        else:
            info["peak_memory"] = peaks[0]
        record.update_sections({"reference": info})
        ctx.save()
    finally:
        scorer.close()


def _reference_semantics(ctx: RunContext) -> LogprobSemantics:
    semantics_record = ctx.record.logprob_semantics
    if semantics_record is None or semantics_record.reference is None:
        raise ConfigError(
            f"{ctx.out} has rollouts but its run.json does not say what their log-probs are",
            hint="re-run with --overwrite",
        )
    return LogprobSemantics.from_record(semantics_record.reference.to_dict())


def analyze_run(ctx: RunContext) -> dict:
    """Stage 3: metrics, per-sequence terms and distributions in one pass; the record is complete.
    Returns the distributions (what the report draws)."""
    out, record = ctx.out, ctx.record
    routing = record.engine.routing if record.engine is not None else None
    with _timed(ctx.timings, "metrics_s"):
        try:
            distributions, sequences = DistributionAccumulator(), SequenceCollector()
            sections = analyze(
                out, ctx.spec.corrections, routing.to_dict() if routing else None, distributions, sequences
            )
        except DataError as exc:
            ctx.fail(exc)
            raise DataError(f"{exc}; the per-token table is kept in {out / TOKENS_DIR}") from None
    if sections.get("decode_vs_prefill") is None:
        sections["decode_vs_prefill"] = record.decode_vs_prefill or None
    sections["samples"] = _sample_summary(out)
    with _timed(ctx.timings, "metrics_s"):
        write_sequences(out, sequences.table)
        dist = distributions.result
        dist["worst_sequences"] = worst_sequences(out, dist["worst"], ctx.tokenizer)
        save_distributions(out, dist)  # token level; the sequence level is sequences.parquet
        dist = with_sequences(dist, sequences.table)
    record.update_sections(
        sections | {"distributions": DISTRIBUTIONS_JSON, "sequences": SEQUENCES_PARQUET, "status": "complete"}
    )
    record.completed_at = now()
    ctx.timings["total_s"] = round(time.perf_counter() - ctx.t_start, 3)
    ctx.save()
    return dist


def render(ctx: RunContext, dist: dict) -> None:
    """Stage 4: figures, report.md and report.html, rendered once from the in-memory record (what
    ``mismatch-probe report`` renders from run.json). A failure here keeps the complete run."""
    from mismatch_probe.report.figures import run_figures

    out, record = ctx.out, ctx.record
    try:
        with _timed(ctx.timings, "figures_s"):
            figures = run_figures(record, dist)
            record.update_sections({"figures": _write_figure_files(out, figures)})
        # the pages show the run's timings up to here; report_s (rendering them) goes to run.json only
        ctx.timings["total_s"] = round(time.perf_counter() - ctx.t_start, 3)
        with _timed(ctx.timings, "report_s"):
            _write_reports(out, record, dist, figures)
    except Exception as exc:  # the run itself is complete on disk; only its rendering failed
        if isinstance(exc, ProbeError):
            raise
        raise ProbeError(
            f"the run is complete in {out}, but rendering its report failed: {type(exc).__name__}: {exc}",
            hint=f"re-render it with `mismatch-probe report {out}`; --debug shows the traceback",
        ) from exc
    ctx.save()


def rerender(run_dir: str | Path) -> Path:
    """Render a finished run's figures, report.md and report.html again from its directory, as
    stage 4 does (after an upgrade, or a rendering that failed); returns report.html's path.
    run.json is rewritten only when its list of figures changes."""
    from mismatch_probe.report.data import load_run
    from mismatch_probe.report.figures import run_figures
    from mismatch_probe.report.html import REPORT_HTML

    data = load_run(run_dir)
    figures = run_figures(data.record, data.dist)
    listed = _write_figure_files(data.path, figures)
    if [f.to_dict() for f in data.record.figures or []] != listed:
        data.record.update_sections({"figures": listed})
        data.record.write(data.path)
    _write_reports(data.path, data.record, data.dist, figures)
    return data.path / REPORT_HTML


def _write_figure_files(run_dir: Path, figures: list[DrawnFigure]) -> list[dict]:
    """The report's figures as SVG files too (``figures/<id>.svg``), for report.md and for slides."""
    from mismatch_probe.report.figures import FIGURES_DIR

    d = run_dir / FIGURES_DIR
    d.mkdir(exist_ok=True)
    for stale in d.glob("*"):  # figures of an earlier version of the report
        if stale.is_file():
            stale.unlink()
    for f in figures:
        write_atomic(run_dir / f.info.path, f.svg)
    return [{"id": f.info.id, "title": f.info.title, "path": f.info.path} for f in figures]


def _write_reports(run_dir: Path, record: RunRecord, dist: dict, figures: list[DrawnFigure]) -> None:
    """report.md and report.html, from the run's one view model."""
    from mismatch_probe.report import html, markdown
    from mismatch_probe.report.model import run_view

    view = run_view(record, run_dir, dist)
    write_atomic(run_dir / REPORT_MD, markdown.render_run(view))
    write_atomic(run_dir / html.REPORT_HTML, html.render_run(view, figures))


def _rollouts(ctx: RunContext, engine: Engine, missing: list[int]) -> None:
    """Sample the missing rollout shards (and re-score them with the engine's prefill)."""
    from mismatch_probe.engines import ScoreRequest
    from mismatch_probe.rollout.multiturn import RetokenizationCheck, ToolTurnTemplate, roll_out

    spec, record, prompts, shards, progress = ctx.spec, ctx.record, ctx.prompts, ctx.shards, ctx.progress
    rollout_dir, tokenizer = ctx.out / ROLLOUTS_DIR, ctx.tokenizer
    semantics = engine.semantics(spec.sampling)
    s = spec.sampling
    prefill_skip = _prefill_skip_reason(spec, engine, semantics)
    info = engine.info()
    sampled_before = len(missing) < len(shards) or (rollout_dir / RECEIVED_DIR).is_dir()
    if sampled_before and record.engine is not None:
        from mismatch_probe.engines.remote import server_changes

        # a remote server restarted between two invocations may run other settings than the
        # rollouts already kept were sampled with; one run must not mix the two
        if changes := server_changes(record.engine.to_dict(), info):
            raise ConfigError(
                f"the server now runs {'; '.join(changes)}, unlike when this run's first samples were drawn",
                hint="restart the server as it was to resume, or start the run again with --overwrite",
            )
    record.update_sections(
        {
            "engine": info,
            "logprob_semantics": _semantics_record(spec, semantics, prefill=prefill_skip is None),
            "decode_vs_prefill": {"skipped": prefill_skip} if prefill_skip else None,
        }
    )
    ctx.save()
    progress.stage("generate", sum(len(shards[i]) for i in missing))
    if prefill_skip is None:
        progress.stage("prefill", sum(len(shards[i]) for i in missing))
    replay = any(prompts[x.prompt_index].recorded for shard in shards for x in shard)
    check, previous_check = RetokenizationCheck(), record.tokenization_check
    template = ToolTurnTemplate.from_tokenizer(tokenizer) if spec.max_turns > 1 or replay else None
    for i in missing:
        shard = shards[i]
        with _timed(ctx.timings, "generation_s"):
            conversations = roll_out(
                engine,
                [prompts[x.prompt_index].token_ids for x in shard],
                [x.sample_id for x in shard],
                s,
                stop_token_ids=ctx.stops,
                seed=s.seed * 1_000_003 + i,
                max_turns=spec.max_turns,
                max_model_len=ctx.model_len,
                tokenizer=tokenizer,
                template=template,
                recorded=[prompts[x.prompt_index].recorded for x in shard],
                on_progress=lambda k: progress.advance("generate", k),
            )
        rollouts = [_rollout(x, prompts[x.prompt_index], c) for x, c in zip(shard, conversations)]
        if template is not None:
            for x, c in zip(shard, conversations):
                check.add(c, prompts[x.prompt_index].messages, tokenizer)
        if prefill_skip is None:
            n_prompt = [len(prompts[x.prompt_index].token_ids) for x in shards[i]]
            with _timed(ctx.timings, "prefill_s"):
                scored = engine.prefill_logprobs(
                    [ScoreRequest(r.token_ids, n) for r, n in zip(rollouts, n_prompt)],
                    on_progress=lambda k: progress.advance("prefill", k),
                )
            for r, n, lp in zip(rollouts, n_prompt, scored):
                if len(lp) != len(r.token_ids) - n:
                    raise DataError(
                        f"sample {r.sample_id}: the engine prefill scored {len(lp)} of "
                        f"{len(r.token_ids) - n} response tokens"
                    )
                r.logp_prefill = np.concatenate([np.full(n, np.nan, np.float32), lp.astype(np.float32)])
        write_table_atomic(rollouts_to_table(rollouts), rollout_dir / shard_name(i))
        if template is not None:
            record.tokenization_check = check.merge(previous_check)
            ctx.save()


def _semantics_record(spec: ProbeSpec, engine: LogprobSemantics, *, prefill: bool) -> dict:
    s = spec.sampling
    ref = reference_semantics(spec.reference.logprobs, engine, s.temperature, s.top_k, s.top_p)
    return {
        "engine": engine.describe(),
        "reference": ref.describe(),
        "matched": ref.distribution() == engine.distribution(),
        "prefill": {"mode": "raw", "distribution": "log_softmax(logits)"} if prefill else None,
    }


ADOPTED_FIELDS = ("engine", "engine_process", "decode_vs_prefill", "tokenization_check", "imported_from")


def _adopt_rollouts(
    spec: ProbeSpec, source: Path, record: RunRecord, n_shards: int, rollout_dir: Path, *, check: bool = True
) -> None:
    """Take ``source``'s rollout shards (hard links where the file system allows) and what it
    recorded about its engine, after checking they were sampled exactly as ``spec`` would
    (``check=False``: ``spec`` was derived from that run's own record, see :func:`score_run`)."""
    from mismatch_probe.config.spec import rollout_fingerprint

    theirs = read_record(source, "--rollouts-from", require_complete=False)
    # computed from absolute paths when that run started (older records: from their spec, which held them)
    theirs_fingerprint = theirs.rollout_fingerprint or rollout_fingerprint(theirs.spec.to_dict())
    if check and theirs_fingerprint != spec.rollout_fingerprint():
        raise ConfigError(
            f"--rollouts-from {source} was sampled with another model, prompt set, engine or sampling setting",
            hint="its spec must match this one everywhere but [reference] and [corrections]",
        )
    engine_semantics = theirs.logprob_semantics.engine if theirs.logprob_semantics is not None else None
    if engine_semantics is None:
        raise ConfigError(
            f"--rollouts-from {source} has no rollouts yet",
            hint=f"finish it first (run its compare command again; it resumes into {source})",
        )
    rollout_dir.mkdir(exist_ok=True)
    for i in range(n_shards):
        mine, src = rollout_dir / shard_name(i), source / ROLLOUTS_DIR / shard_name(i)
        if mine.is_file():
            continue
        if not src.is_file():
            raise ConfigError(
                f"--rollouts-from {source} lacks rollout shard {i} ({src.name})",
                hint="finish it first (run its compare command again; it resumes)",
            )
        with atomic_path(mine) as tmp:
            try:
                os.link(src, tmp)
            except OSError:  # another file system, or links not allowed
                shutil.copyfile(src, tmp)
    for key in ADOPTED_FIELDS:
        setattr(record, key, getattr(theirs, key))
    prefill = theirs.logprob_semantics is not None and theirs.logprob_semantics.prefill is not None
    record.update_sections(
        {
            "logprob_semantics": _semantics_record(
                spec, LogprobSemantics.from_record(engine_semantics.to_dict()), prefill=prefill
            ),
            "rollouts_from": {
                "run": relative_to_dir(source, rollout_dir.parent),
                "spec_fingerprint": theirs.spec_fingerprint,
            },
        }
    )


# ---- the stages as commands: sample here, score and analyze later, elsewhere -------------------


def sample_run(spec: ProbeSpec, *, progress: Progress | None = None, overwrite: bool = False) -> RunContext:
    """``mismatch-probe sample``: stage 1 alone (the engine only). The run directory then holds the
    rollouts and the engine's half of the record; :func:`score_run` and :func:`analyze_existing`
    take it from there, in another process or on another machine."""
    ctx = prepare(spec, progress=progress, overwrite=overwrite)
    sample(ctx)
    ctx.timings["total_s"] = round(time.perf_counter() - ctx.t_start, 3)  # the later stages add to it
    ctx.save()
    return ctx


def open_run(run_dir: str | Path, *, progress: Progress | None = None, model: str | Path | None = None) -> RunContext:
    """The context of an existing run directory, from its record alone (no prompts file, no engine):
    what ``score`` and ``analyze`` run on. ``model`` replaces the checkpoint path the record names
    (relative to the working directory it ran in), e.g. when scoring on another machine."""
    from mismatch_probe.modeling.loading import check_model_dir, load_tokenizer, max_model_len

    out = Path(run_dir)
    record = read_record(out, "run directory", require_complete=False)
    spec = _recorded_spec(record, out, model)
    try:
        model_path = check_model_dir(str(spec.model))
    except ConfigError as exc:
        if model is not None:
            raise
        raise ConfigError(
            f"{exc.message}: the checkpoint {out} was sampled from is not there from here",
            hint="pass --model PATH (the same checkpoint)",
        ) from None
    inputs = record.inputs
    if inputs is None or inputs.n_samples is None or inputs.n_shards is None:
        raise ConfigError(f"{out}/run.json does not say how many samples the run has", hint="sample it again")
    n = spec.sampling.n
    samples = [_Sample(sid, sid // n) for sid in range(inputs.n_samples)]
    shards = [samples[i : i + spec.shard_size] for i in range(0, len(samples), spec.shard_size)]
    if len(shards) != inputs.n_shards:
        raise DataError(
            f"{out}/run.json: {inputs.n_samples} samples in shards of {spec.shard_size} are not {inputs.n_shards} shards"
        )
    tokenizer = load_tokenizer(model_path, trust_remote_code=spec.trust_remote_code)
    return RunContext(
        spec=spec,
        out=out,
        record=record,
        progress=progress or Progress(),
        entry=None,
        model_path=model_path,
        tokenizer=tokenizer,
        model_len=max_model_len(model_path, tokenizer),
        prompts=[],  # the sampling stage's input; the later stages read the rollouts
        stops=list(inputs.stop_token_ids),
        shards=shards,
        t_start=time.perf_counter() - record.timings.get("total_s", 0.0),
        resuming=True,
    )


def _recorded_spec(record: RunRecord, out: Path, model: str | Path | None) -> ProbeSpec:
    """The spec a run was made with, as run.json records it, with its paths found again: the model
    and prompts as ``inputs`` names them (relative to the working directory), ``out`` the directory."""
    from pydantic import ValidationError

    d = record.spec.to_dict()
    inputs = record.inputs
    d["model"] = (
        str(Path(model).resolve()) if model is not None else str(Path(inputs.model or "").resolve()) if inputs else None
    )
    d["prompts"] = str(Path(inputs.prompts).resolve()) if inputs is not None and inputs.prompts else d.get("prompts")
    d["out"] = str(out)
    if isinstance(d.get("engine"), dict):
        d["engine"] = {**d["engine"], "python": None}  # where the engine ran; the later stages start none
    try:
        return ProbeSpec.model_validate(d)
    except ValidationError as exc:
        raise ConfigError(
            f"{out}/run.json records a spec this version cannot read ({exc.errors()[0]['msg']})",
            hint=f"score it with the mismatch-probe that sampled it ({record.probe_version})",
        ) from None


def _require_shards(ctx: RunContext, directory: str, what: str, stage: str) -> None:
    missing = ctx.missing(directory)
    if missing:
        raise ConfigError(
            f"{ctx.out} has {len(ctx.shards) - len(missing)} of {len(ctx.shards)} {what} shards",
            hint=f"finish it first: {stage}",
        )


def score_run(
    run_dir: str | Path,
    *,
    out: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    model: str | Path | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> RunContext:
    """``mismatch-probe score``: stage 2 alone, on a sampled run. With ``out``, a new run directory
    that links ``run_dir``'s rollouts and scores them with ``overrides`` of its ``[reference]`` and
    ``[corrections]``; without, the missing token shards of ``run_dir`` itself.

    Under torchrun every rank calls this: the ranks join torchrun's process group and score as
    data-parallel groups (:mod:`mismatch_probe.reference.data_parallel`); rank 0 alone writes the record."""
    from mismatch_probe.config.spec import apply_overrides
    from mismatch_probe.reference.launch import torchrun_launch

    launch = torchrun_launch()
    source = open_run(run_dir, progress=progress, model=model)
    _require_shards(source, ROLLOUTS_DIR, "rollout", f"mismatch-probe sample (its spec, --out {run_dir})")
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    bad = [k for k in overrides if k.partition(".")[0] not in ("reference", "corrections")]
    if bad:
        raise ConfigError(
            f"score sets {', '.join(bad)}: only [reference] and [corrections] settings score the same rollouts",
            hint="sample again with another spec for other settings",
        )
    spec = source.spec
    if out is not None:
        spec = source.spec.model_copy(deep=True)
        apply_overrides(spec, overrides)
        spec.out = str(out)
        spec.name = None
        spec.validate()
        if launch is None and spec.reference.sequence_parallel_size * spec.reference.tensor_parallel_size > 1:
            from mismatch_probe.reference.distributed import check_reference_layout

            check_reference_layout(source.model_path, spec.reference, trust_remote_code=spec.trust_remote_code)
    elif overrides:
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
        return _score_run_launched(source, spec, launch, out, model=model, overwrite=overwrite)
    ctx = source if out is None else _derived_run(source, spec, Path(out), overwrite=overwrite)
    score(ctx)
    ctx.timings["total_s"] = round(time.perf_counter() - ctx.t_start, 3)
    ctx.save()
    return ctx


def _score_run_launched(
    source: RunContext, spec: ProbeSpec, launch, out: str | Path | None, *, model, overwrite: bool
) -> RunContext:
    """:func:`score_run` on one rank of a torchrun launch."""
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
            on_lead(lambda: made.append(_derived_run(source, spec, Path(out), overwrite=overwrite)))
            ctx = made[0] if made else open_run(out, progress=source.progress, model=model)
        score_data_parallel(ctx, launch, _reference_semantics(ctx))
        if launch.is_lead:
            ctx.timings["total_s"] = round(time.perf_counter() - ctx.t_start, 3)
            ctx.save()
        return ctx
    finally:
        dist.destroy_process_group()


def _derived_run(source: RunContext, spec: ProbeSpec, out: Path, *, overwrite: bool) -> RunContext:
    """A new run directory scoring ``source``'s rollouts with ``spec`` (its reference settings)."""
    from mismatch_probe.environment import fingerprint

    previous = prepare_run_dir(spec, out, overwrite=overwrite)
    inputs = source.record.inputs.to_dict() if source.record.inputs is not None else {}
    record = parse_record(
        {
            "schema_version": SCHEMA_VERSION,
            "probe_version": __version__,
            "status": "running",
            "created_at": previous.created_at if previous is not None and previous.created_at else now(),
            "spec": spec.to_dict(),
            "spec_fingerprint": spec.fingerprint(),
            "rollout_fingerprint": source.record.rollout_fingerprint,
            "environment": fingerprint(),
            "inputs": inputs,
            **{key: getattr(previous, key, None) for key in CARRIED_SECTIONS},
            "timings": {},
        }
    )
    ctx = RunContext(
        spec=spec,
        out=out,
        record=record,
        progress=source.progress,
        entry=None,
        model_path=source.model_path,
        tokenizer=source.tokenizer,
        model_len=source.model_len,
        prompts=[],
        stops=source.stops,
        shards=source.shards,
        t_start=time.perf_counter(),
        resuming=previous is not None,
    )
    _adopt_rollouts(spec, source.out, record, len(ctx.shards), out / ROLLOUTS_DIR, check=False)
    ctx.save()
    return ctx


def analyze_existing(
    run_dir: str | Path, *, progress: Progress | None = None, model: str | Path | None = None
) -> RunResult:
    """``mismatch-probe analyze``: stages 3 and 4 on a scored run (metrics, sequences, the report)."""
    ctx = open_run(run_dir, progress=progress, model=model)
    _require_shards(ctx, ROLLOUTS_DIR, "rollout", f"mismatch-probe sample (its spec, --out {run_dir})")
    _require_shards(ctx, TOKENS_DIR, "scored token", f"mismatch-probe score {run_dir}")
    dist = analyze_run(ctx)
    render(ctx, dist)
    return RunResult(ctx.out, ctx.record)


@dataclass
class VariantsResult:
    base_dir: Path
    runs: dict[str, RunResult]
    comparison: Path


def run_variants(
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
    spec.validate()
    base = Path(spec.out) if spec.out else default_out_dir(spec)
    runs: dict[str, RunResult] = {}
    source = Path(rollouts_from) if rollouts_from else None
    for name, variant in spec.expand_variants(base):
        progress.log(f"variant {name}" + (f": scoring the rollouts of {source}" if source else ""))
        runs[name] = run_compare(variant, progress=progress, overwrite=overwrite, rollouts_from=source)
        source = source or runs[name].run_dir
    comparison = write_report([r.run_dir for r in runs.values()], base / "compare.html").path
    return VariantsResult(base, runs, comparison)


def _prefill_skip_reason(spec: ProbeSpec, engine, semantics: LogprobSemantics) -> str | None:
    """Why the decode-vs-prefill check does not run, or None when it does."""
    if not spec.engine.prefill_check:
        return "turned off (engine.prefill_check = false)"
    if not getattr(engine, "supports_prefill", hasattr(engine, "prefill_logprobs")):
        return f"the {spec.engine.name} engine cannot re-score sequences with its own prefill"
    if semantics.transforms_logits:
        return (
            f"the engine returns processed log-probs ({semantics.describe()['distribution']}) but prefill "
            "log-probs are raw, so the two are not comparable; use logprobs_mode = raw to see it"
        )
    return None


def _rollout(sample: _Sample, prompt, conversation) -> Rollout:
    experts = conversation.experts
    return Rollout(
        sample_id=sample.sample_id,
        prompt_id=prompt.id,
        token_ids=np.concatenate(conversation.ids).astype(np.int32),
        turn=np.concatenate(conversation.turn),
        is_model_token=np.concatenate(conversation.model),
        logp_infer=np.concatenate(conversation.logp),
        finish_reason=conversation.finish_reason,
        experts_infer=np.concatenate(experts) if experts else None,
    )


def _sample_summary(run_dir: Path) -> dict:
    import pyarrow.parquet as pq

    from mismatch_probe.table.tokens import list_values, shard_paths

    finish: dict[str, int] = {}
    counts = []
    for path in shard_paths(run_dir, ROLLOUTS_DIR):
        t = pq.read_table(path, columns=["is_model_token", "finish_reason"])
        reasons, n = np.unique(t.column("finish_reason").to_numpy(zero_copy_only=False), return_counts=True)
        for reason, k in zip(reasons, n):
            finish[str(reason)] = finish.get(str(reason), 0) + int(k)
        mask, offsets = list_values(t.column("is_model_token"), np.int64)
        cum = np.concatenate([[0], np.cumsum(mask)])
        counts.append(cum[offsets[1:]] - cum[offsets[:-1]])
    n_model = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    return {
        "finish_reasons": finish,
        "n_empty_responses": int((n_model == 0).sum()),
        "response_tokens_mean": float(n_model.mean()) if len(n_model) else None,
        "response_tokens_max": int(n_model.max()) if len(n_model) else None,
    }
