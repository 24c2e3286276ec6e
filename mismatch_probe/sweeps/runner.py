"""``mismatch-probe sweep``: many runs around one spec, and what they say together.

Each point of the ``[sweep]`` (:func:`config.sweep.sweep_points`) is a normal run directory under
``DIR/points/<name>/``, made by the pipeline's own stages. What the sweep adds:

* **one engine start per distinct engine configuration**: the points that share one (the baseline,
  its repeats, sampling changes) sample with the same engine; it is closed before any of them
  scores, so engine and reference never hold an accelerator's memory at once;
* **paired re-scoring**: a point that changes only reference (or correction) settings scores the
  tokens of the earlier point with the same rollouts (``rollouts_from``), so its effect is exact;
* **refusals**: a setting the engine (or the spec's rules) will not run is recorded with its reason,
  and the sweep goes on; a point that fails later is recorded as failed, and retried on a re-run;
* **resume**: finished points are skipped, a half-finished one resumes from its shards;
* **many machines**: ``shard`` runs a share of the engine-configuration groups (a Slurm array),
  ``executor="ray"`` each group as a Ray task (:mod:`sweeps.units`, :mod:`sweeps.ray_executor`);
* ``sweep.json`` (:mod:`sweep_record`) with effects, noise floor, determinism, cost and the
  recommendation (:mod:`analysis.sweep`), rendered to ``sweep.md`` and ``sweep.html``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.config.spec import FINGERPRINT_SCHEMA, ProbeSpec
from mismatch_probe.config.spec_reading import load_spec_file
from mismatch_probe.config.sweep import (
    BASELINE,
    EXECUTORS,
    POINTS_DIR,
    STATE_JSON,
    SweepPlan,
    SweepPoint,
    sweep_points,
)
from mismatch_probe.errors import ConfigError, ProbeError
from mismatch_probe.files import portable_path, write_atomic
from mismatch_probe.pipeline import Progress, RunContext, stages
from mismatch_probe.record import json_safe, now, read_record
from mismatch_probe.report.html import REPORT_HTML
from mismatch_probe.report.pages import render_again as rerender
from mismatch_probe.sweep_record import SWEEP_JSON, SweepRecord
from mismatch_probe.sweeps.summary import SweepRun, complete_record, summarize
from mismatch_probe.sweeps.units import UNITS_DIR, Group, Shard, SweepState, engine_groups, shard_groups, summary_lock
from mismatch_probe.table.tokens import ROLLOUTS_DIR, read_rollout_shard

ENGINES_DIR = "engines"  # one log per engine start (engines are shared between points)
DETERMINISM_JSON = "determinism.json"
# the run timings that are engine or reference compute; the rest of a sweep's time is its overhead
COMPUTE_TIMINGS = ("generation_s", "prefill_s", "reference_load_s", "scoring_s")


class SweepProgress(Progress):
    """A progress sink that also hears about points; the CLI's shows points done, engine starts, ETA."""

    def point(self, name: str, done: int, total: int, engine_starts: int) -> None: ...


@dataclass
class SweepResult:
    out: Path
    record: SweepRecord | None  # None: a shard finished its share, and other shards' points are not done
    waiting: list[str] = field(default_factory=list)  # those points, by name

    @property
    def exit_code(self) -> int:
        """With a gate: 0 when the baseline or a recommended change passes, 1 when none does."""
        if self.record is None:
            return 0
        rec = self.record.recommendation
        if rec is None or rec.get("gate") is None:
            return 0
        return 0 if rec.get("passes") else 1

    @property
    def html(self) -> Path:
        return self.out / "sweep.html"


EngineFactory = Callable[..., Any]


def _default_engine_factory(entry, model_path, engine_spec, *, log_path, trust_remote_code):
    from mismatch_probe.engines.process import EngineProcess

    return EngineProcess(entry, model_path, engine_spec, log_path=log_path, trust_remote_code=trust_remote_code)


def sweep(
    spec: ProbeSpec | str | Path,
    *,
    out: str | Path | None = None,
    gate: str | Path | None = None,
    resume: bool = True,
    progress: SweepProgress | None = None,
    engine_factory: EngineFactory | None = None,
    shard: Shard | str | None = None,
    summarize_only: bool = False,
    executor: str = "local",
    ray_address: str | None = None,
) -> SweepResult:
    """Run every point of ``spec``'s ``[sweep]`` (a spec, or the path of a spec file) and write
    ``sweep.json``, ``sweep.md`` and ``sweep.html`` under ``out`` (default: the spec's ``out``).

    ``gate`` (a thresholds file) checks every point and names the cheapest passing change.
    ``resume=False`` replaces an earlier sweep in ``out``; by default its finished points are kept.
    ``engine_factory`` replaces the engine worker (tests script engines with it).

    Across machines (:mod:`sweeps.units`): ``shard="i/N"`` runs shard i's share of the engine
    configurations, and writes the summary if every other point is done too (else the result has no
    record, and ``waiting`` names the points still to come); ``summarize_only`` writes the summary of
    a sweep whose shards all finished; ``executor="ray"`` runs each engine configuration as a Ray task
    on the cluster at ``ray_address`` (default: ``RAY_ADDRESS``, else a local one)."""
    if not isinstance(spec, ProbeSpec):
        spec = load_spec_file(spec)
    if isinstance(shard, str):
        shard = Shard.parse(shard)
    if sum([shard is not None, summarize_only, executor != "local"]) > 1:
        raise ConfigError("--shard, --summarize and --executor ray are different ways to run a sweep: pick one")
    if executor not in EXECUTORS:
        raise ConfigError(f"--executor {executor!r}: choose one of {', '.join(EXECUTORS)}")
    if not resume and (shard is not None or summarize_only):
        raise ConfigError(
            "--no-resume with --shard or --summarize would delete the other shards' points",
            hint="empty the output directory before the shards start instead",
        )
    progress = progress or SweepProgress()
    factory = engine_factory or _default_engine_factory
    if executor == "ray":
        from mismatch_probe.sweeps.ray_executor import run_groups_on_ray

        driver = _Sweep(spec, out, gate, resume, progress, factory, unit=None)
        groups = driver.groups()  # the invalid points refused first, as a local sweep does
        waiting = set(driver.waiting())
        todo = [g for g in groups if any(p.name in waiting for p in g.members)]
        run_groups_on_ray(todo, run_group, spec=spec, out=driver.out, gate=gate, progress=progress, address=ray_address)
        return driver.summarize_only()
    if summarize_only:
        return _Sweep(spec, out, gate, True, progress, factory, unit=None).summarize_only()
    unit = None if shard is None else shard.unit
    select = None if shard is None else (lambda groups: shard_groups(groups, shard))
    return _Sweep(spec, out, gate, resume, progress, factory, unit=unit).run(select)


class _PrintProgress(SweepProgress):
    """A Ray task's progress: a line per event on its stderr, which Ray forwards to the driver."""

    def __init__(self, unit: str) -> None:
        self.unit = unit

    def log(self, message: str) -> None:
        print(f"[{self.unit}] {message}", file=sys.stderr, flush=True)

    def point(self, name: str, done: int, total: int, engine_starts: int) -> None:
        self.log(f"{name} done ({done}/{total} runs of this group, {engine_starts} engine starts)")


def run_group(spec: ProbeSpec, out: str, gate: str | None, key: str, cwd: str) -> dict[str, Any]:
    """One engine configuration of the sweep in ``out``, as a Ray task runs it (``sweeps.ray_executor``):
    in the driver's working directory, its state in ``shards/group-<key>.json``, no summary."""
    if Path(cwd).is_dir():
        os.chdir(cwd)  # the spec's relative paths are the driver's
    unit = Group(key, [], {}).unit
    sweep = _Sweep(spec, out, gate, True, _PrintProgress(unit), _default_engine_factory, unit=unit)
    sweep.run(lambda groups: [g for g in groups if g.key == key], summarize=False)
    return {"group": key, "engine_starts": sweep.engine_starts}


class _Sweep:
    def __init__(
        self,
        spec: ProbeSpec,
        out: str | Path | None,
        gate: str | Path | None,
        resume: bool,
        progress: SweepProgress,
        engine_factory: EngineFactory,
        *,
        unit: str | None,
    ) -> None:
        from mismatch_probe.gate.checks import load_gate

        self.t0 = time.perf_counter()
        out = Path(out) if out is not None else (Path(spec.out) if spec.out else None)
        if out is None:
            raise ConfigError("no output directory for the sweep", hint="pass --out DIR or set out = ... in the spec")
        self.out = out
        self.plan: SweepPlan = sweep_points(spec, out)  # every setting checked before anything is written
        self.gate_file = Path(gate) if gate is not None else None
        self.gate = load_gate(gate) if gate is not None else None
        self.spec, self.progress, self.factory = spec, progress, engine_factory
        self.engine_starts = 0
        self.timings: dict[str, float] = {"engine_start_s": 0.0, "engine_stop_s": 0.0, "determinism_s": 0.0}
        self.compute_s = 0.0
        # scored points whose figures and reports are still to draw (see _start_engine)
        self.deferred: list[tuple[SweepPoint, RunContext, dict]] = []
        self.unit = unit  # a shard's or a Ray task's name: its state goes to shards/<unit>.json
        self._prepare_dir(resume)

    # ---- the directory -------------------------------------------------------------------
    def _prepare_dir(self, resume: bool) -> None:
        out, state_path = self.out, self.out / STATE_JSON
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
        # hidden files: another shard's state being written, the summary's lock
        if out.is_dir() and any(not p.name.startswith(".") for p in out.iterdir()):
            if not state_path.is_file():
                raise ConfigError(f"--out {str(out)!r} is not empty and holds no sweep", hint="choose another --out")
            state = json.loads(state_path.read_text())
            if not resume:
                for name in (POINTS_DIR, ENGINES_DIR, UNITS_DIR):
                    shutil.rmtree(out / name, ignore_errors=True)
                for name in (STATE_JSON, SWEEP_JSON, DETERMINISM_JSON, "sweep.md", "sweep.html"):
                    (out / name).unlink(missing_ok=True)
            elif state.get("fingerprint") != self.plan.fingerprint(state.get("fingerprint_schema", 3)):
                raise ConfigError(
                    f"--out {str(out)!r} holds a sweep of another spec",
                    hint="use another --out, or --no-resume to replace it",
                )
        out.mkdir(parents=True, exist_ok=True)
        self.state = SweepState(out, self.unit)
        if "fingerprint" not in self.state.main:
            # every shard starting on an empty directory writes the same: the spec's
            self.state.main.update(fingerprint=self.plan.fingerprint(), fingerprint_schema=FINGERPRINT_SCHEMA)
            self.state.save_main()

    def _refuse(self, point: SweepPoint, reason: str) -> None:
        # a refusal is the engine's (or the spec's) answer to a setting: the same on a re-run
        self.state.refuse(point.name, reason)
        self._drop_unsampled(point)
        self.progress.log(f"{point.name}: refused: {reason}")

    def _drop_unsampled(self, point: SweepPoint) -> None:
        """A refused point's run directory holds only the record prepare wrote: remove it, so
        points/ lists the runs that exist (sweep.json keeps the refusal and its reason)."""
        if point.run_dir.is_dir() and not (point.run_dir / ROLLOUTS_DIR).exists():
            shutil.rmtree(point.run_dir)

    def _is_complete(self, point: SweepPoint) -> bool:
        done = complete_record(point) is not None
        if done and not (point.run_dir / REPORT_HTML).is_file():
            rerender(point.run_dir)  # stopped between its analysis and its pages
        return done

    # ---- running -------------------------------------------------------------------------
    def groups(self) -> list[Group]:
        """The engine-configuration groups of the points that can run (the invalid ones refused);
        ``self.source``: the point each re-scoring point takes its tokens from."""
        refused = self.state.refused
        for p in self.plan.points:
            if p.spec is None and p.name not in refused:
                self._refuse(p, p.refusal or "not a valid setting")
            elif p.name in refused:
                self._drop_unsampled(p)  # refused by an earlier version that kept the directory
        refused = self.state.refused
        groups = engine_groups([p for p in self.plan.runs if p.spec is not None and p.name not in refused])
        self.source = {name: src for g in groups for name, src in g.source.items()}
        return groups

    def run(self, select: Callable[[list[Group]], list[Group]] | None = None, *, summarize: bool = True) -> SweepResult:
        """Run the groups ``select`` picks (default: all), then write the summary if every point of
        the sweep is done (and ``summarize``: a Ray task leaves it to its driver)."""
        self.state.begin()
        groups = self.groups()
        mine = groups if select is None else select(groups)
        self.total = sum(len(g.members) for g in mine)
        self.done = 0
        if self.unit is None:  # the refused points are part of a whole sweep's count
            self.total, self.done = len(self.plan.runs), len(self.plan.runs) - sum(len(g.members) for g in groups)
        try:
            for group in mine:
                self._run_group(group.key, group.members)
            while self.deferred:
                self._render_next()
        finally:
            self.timings["total_s"] = round(time.perf_counter() - self.t0, 3)
        return self._finish(summarize)

    def summarize_only(self) -> SweepResult:
        """The summary of a sweep whose points were run elsewhere (its shards, its Ray tasks)."""
        self.groups()
        waiting = self.waiting()
        if waiting:
            shown = ", ".join(waiting[:5]) + (f" and {len(waiting) - 5} more" if len(waiting) > 5 else "")
            seen = sorted(p.stem for p in (self.out / UNITS_DIR).glob("*.json"))
            raise ConfigError(
                f"{len(waiting)} point(s) of the sweep in {str(self.out)!r} are not done: {shown}",
                hint="run the shards whose points these are again (shards that have run here: "
                f"{', '.join(seen) or 'none'}), then --summarize",
            )
        return self._summarize(time.perf_counter())

    def waiting(self) -> list[str]:
        """The points neither complete, refused nor failed: another shard's, still running (or killed)."""
        refused, failures = self.state.refused, self.state.failures
        return [
            p.name
            for p in self.plan.runs
            if p.name not in refused and p.name not in failures and complete_record(p) is None
        ]

    def _tick(self, point: SweepPoint) -> None:
        self.done += 1
        self.progress.point(point.name, self.done, self.total, self.engine_starts)

    def _run_group(self, key: str, members: list[SweepPoint]) -> None:
        """Sample every point of one engine configuration with one engine, close it, then score."""
        samplers = [p for p in members if p.name not in self.source]
        rescorers = [p for p in members if p.name in self.source]
        pending = [p for p in samplers if not self._is_complete(p)]
        contexts: dict[str, RunContext] = {}
        engine = None
        with_baseline = any(p.is_baseline for p in members)
        need_determinism = with_baseline and self.plan.sweep.determinism and not (self.out / DETERMINISM_JSON).is_file()
        try:
            for p in pending:
                assert p.spec is not None
                try:
                    ctx = stages.prepare(p.spec, progress=self.progress, engine=engine)
                except ConfigError as exc:
                    if p.is_baseline or p.repeat:
                        raise  # no baseline, nothing to compare with: that is the user's to fix
                    for q in members:
                        self._refuse(q, str(exc))
                        self._tick(q)
                    return
                contexts[p.name] = ctx
                # a [sync] point starts its own engines (from its start checkpoint, then a fresh one)
                if ctx.missing(ROLLOUTS_DIR) and engine is None and not p.spec.sync.enabled:
                    assert ctx.inputs is not None  # prepared here, to sample
                    engine = self._start_engine(key, p.spec, members, ctx.inputs.prompts[0].token_ids)
                    if engine is None:
                        return
                try:
                    stages.sample(ctx, engine=engine)
                except ProbeError as exc:
                    self._fail(p, exc)
                    contexts.pop(p.name)
            if need_determinism and BASELINE not in self.state.own["failures"]:
                baseline = self.plan.baseline
                assert baseline.spec is not None
                if engine is None:
                    engine = self._start_engine(key, baseline.spec, members, None)
                if engine is not None:
                    self._determinism(engine, baseline.spec)
        finally:
            if engine is not None:
                t = time.perf_counter()
                engine.close()
                self.timings["engine_stop_s"] += time.perf_counter() - t
        for p in samplers:
            if p.name in contexts:
                self._score(p, contexts[p.name])
            elif p.name not in self.state.own["failures"] and p.name not in self.state.refused:
                self._tick(p)  # complete before this invocation
        for p in rescorers:
            self._rescore(p)

    def _start_engine(self, key: str, spec: ProbeSpec, members: list[SweepPoint], warmup: np.ndarray | None):
        """The engine of one configuration; None when it refuses to start (its points are refused).

        While the engine starts (tens of seconds, mostly its worker importing and loading), the
        points already scored have their figures and reports drawn here: CPU work that needs no
        accelerator memory, so it can overlap the start. ``warmup`` (a prompt) is generated once
        before any timing, so every point's throughput is the engine's steady state, not its
        first batch's allocations and kernel selection."""
        from concurrent.futures import ThreadPoolExecutor

        from mismatch_probe.engines import GenerationRequest, get_entry

        entry = get_entry(spec.engine.name)
        log = self.out / ENGINES_DIR / f"{key}.log"
        names = ", ".join(p.name for p in members)
        self.progress.log(f"starting engine {entry.name} for {names} (log: {portable_path(log)})")
        t = time.perf_counter()
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="engine-start") as pool:
                started = pool.submit(
                    self.factory,
                    entry,
                    Path(str(spec.model)),  # validated: always set
                    spec.engine,
                    log_path=log,
                    trust_remote_code=spec.trust_remote_code,
                )
                while not started.done() and self.deferred:
                    self._render_next()
                engine = started.result()
            if warmup is not None:
                try:
                    engine.generate(
                        [GenerationRequest(warmup, 8)], spec.sampling, stop_token_ids=[], seed=spec.sampling.seed
                    )
                except BaseException:
                    engine.close()  # an engine that cannot generate must not hold its memory
                    raise
        except ProbeError as exc:
            if any(p.is_baseline or p.repeat for p in members):
                raise  # no baseline, nothing to compare with: the user's to fix
            for q in members:
                self._refuse(q, str(exc))
                self._tick(q)
            return None
        finally:
            self.timings["engine_start_s"] += time.perf_counter() - t
        self.engine_starts += 1
        return engine

    def _fail(self, point: SweepPoint, exc: BaseException) -> None:
        if point.is_baseline or point.repeat:
            raise exc
        self.state.fail(point.name, str(exc))
        self.progress.log(f"{point.name}: failed: {exc}")
        self._tick(point)

    def _score(self, point: SweepPoint, ctx: RunContext) -> None:
        """Score and analyze a sampled point; its figures and report are drawn later (deferred)."""
        try:
            stages.score(ctx)
            dist = stages.analyze(ctx)
        except ProbeError as exc:
            self._fail(point, exc)
            return
        self.compute_s += sum(ctx.timings.get(k, 0.0) for k in COMPUTE_TIMINGS)
        self.deferred.append((point, ctx, dist))
        self._tick(point)

    def _render_next(self) -> None:
        point, ctx, dist = self.deferred.pop(0)
        try:
            stages.render(ctx, dist)
        except ProbeError as exc:  # the run is complete; only its pages are missing
            self.progress.log(f"{point.name}: {exc}")

    def _rescore(self, point: SweepPoint) -> None:
        source = self.source[point.name]
        if source.name in self.state.own["failures"] or source.name in self.state.refused:
            self.state.fail(point.name, f"the point whose tokens it re-scores ({source.name}) did not finish")
            self._tick(point)
            return
        if self._is_complete(point):
            self._tick(point)
            return
        assert point.spec is not None and source.spec is not None
        try:
            ctx = stages.prepare(point.spec, progress=self.progress, rollouts_from=source.run_dir)
            stages.sample(ctx, rollouts_from=source.run_dir)
        except ProbeError as exc:
            self._fail(point, exc)
            return
        self._score(point, ctx)

    def _determinism(self, engine, spec: ProbeSpec) -> None:
        """Re-score the baseline's sequences in other batch compositions, and sample twice with one
        seed: how far the engine is from giving the same log-probs for the same tokens. Reads only
        the baseline's rollouts and record, so it also runs for a baseline finished earlier."""
        from mismatch_probe.pipeline.determinism import engine_determinism

        t = time.perf_counter()
        k = self.plan.sweep.determinism_sequences
        run_dir = self.plan.baseline.run_dir
        inputs = read_record(run_dir, require_complete=False).inputs
        stops = inputs.stop_token_ids if inputs is not None else []
        rollouts = []
        for path in sorted((run_dir / ROLLOUTS_DIR).glob("part-*.parquet")):
            rollouts.extend(read_rollout_shard(path))
            if len(rollouts) >= 2 * k:
                break
        result = engine_determinism(
            engine, rollouts[:k], rollouts[k : 2 * k], spec.sampling, stop_token_ids=stops, engine_name=spec.engine.name
        )
        elapsed = time.perf_counter() - t
        self.timings["determinism_s"] += elapsed
        self.compute_s += elapsed
        write_atomic(self.out / DETERMINISM_JSON, json.dumps(json_safe(result), indent=2) + "\n")

    # ---- the record ----------------------------------------------------------------------
    def _finish(self, summarize: bool = True) -> SweepResult:
        """Record this invocation; then the summary, unless a shard's points are still to come."""
        t = time.perf_counter()
        timings = {k: round(v, 3) for k, v in self.timings.items()}
        compute = self.compute_s + self.timings["engine_start_s"] + self.timings["engine_stop_s"]
        timings["compute_s"] = round(compute, 3)
        timings["total_s"] = round(time.perf_counter() - self.t0, 3)
        timings["overhead_s"] = round(timings["total_s"] - compute, 3)
        # every invocation that ran points, so a resumed or sharded sweep still says what it cost
        entry: dict[str, Any] = {"finished_at": now(), "engine_starts": self.engine_starts, "timings": timings}
        if self.unit is not None:
            entry["unit"] = self.unit
        self.state.add_invocation(entry)
        if self.unit is not None:
            waiting = self.waiting()
            if not summarize:
                return SweepResult(self.out, None, waiting)
            if waiting:
                self.progress.log(
                    f"{self.unit}: done; {len(waiting)} point(s) of other shards to come "
                    "(the last shard to finish, or sweep --summarize, writes sweep.json)"
                )
                return SweepResult(self.out, None, waiting)
        return self._summarize(t, timings)

    def _summarize(self, t: float, timings: dict[str, float] | None = None) -> SweepResult:
        with summary_lock(self.out):
            self.state.reload_main()  # the throughputs another shard's summary may have kept
            state = {"refused": self.state.refused, "throughput": self.state.main.setdefault("throughput", {})}
            record = summarize(
                SweepRun(
                    spec=self.spec,
                    plan=self.plan,
                    out=self.out,
                    state=state,
                    source=self.source,
                    failures=self.state.failures,
                    gate=self.gate,
                    gate_file=self.gate_file,
                    engine_starts=self.engine_starts,
                )
            )
            self.state.save_main()  # with the throughputs measured, for a later resume
            timings = dict(timings or {})
            timings["summary_s"] = round(time.perf_counter() - t, 3)
            timings["total_s"] = round(time.perf_counter() - self.t0, 3)
            if self.state.own.get("invocations"):  # this invocation's own entry, now with its summary
                self.state.own["invocations"][-1]["timings"] = timings
                self.state.save()
            invocations = self.state.invocations
            record.timings = timings
            record.invocations = invocations
            record.engine_starts = sum(i["engine_starts"] for i in invocations)
            record.write(self.out)
            from mismatch_probe.report.pages import write_sweep_reports

            write_sweep_reports(self.out, record)
        return SweepResult(self.out, record)
