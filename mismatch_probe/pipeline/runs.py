"""Run directories and their records: how a run is created, resumed, derived and opened.

A run is a directory with a ``run.json`` (:class:`~mismatch_probe.record.RunRecord`) and its
shards. :func:`create_run` is the one way a run directory and its record come to be (``compare``
and every sweep point through :func:`~mismatch_probe.pipeline.stages.prepare`, ``score --out``
through :func:`derive_run`, ``import``), and :func:`open_run` the one way an existing one is
opened (``score``, ``analyze``, an imported run). Both give the :class:`RunContext` the stages
share. See ARCHITECTURE.md, "Stages" and "Run record".
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.config.spec import FINGERPRINT_SCHEMA, ProbeSpec
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.record import SCHEMA_VERSION, RunRecord, find_record, json_safe, now, parse_record, read_record
from mismatch_probe.table.tokens import shard_name
from mismatch_probe.version import __version__

if TYPE_CHECKING:
    from mismatch_probe.engines import EngineEntry
    from mismatch_probe.rollout.prompts import Prompt

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
    "server_template_check",
    "precision",  # an adaptive run's rounds so far: a resumed run goes on from them (pipeline/adaptive.py)
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


@dataclass(frozen=True)
class SampleRef:
    """One sample of a run: its id and the prompt it answers (by position in the prompts file)."""

    sample_id: int
    prompt_index: int


def shard_samples(
    n_samples: int, n: int, shard_size: int, *, n_prompts: int | None = None, rounds: list[int] | None = None
) -> list[list[SampleRef]]:
    """A run's samples (``n`` per prompt, numbered prompt by prompt) in shards of ``shard_size``:
    the unit of sampling, scoring and resume.

    An adaptive run (``sampling.precision``, :mod:`.adaptive`) samples in ``rounds`` (their sizes,
    summing to ``n_samples``), each in shards of its own, so the shards of the rounds already
    sampled stay what they were when another round is added; past the ``n_prompts`` x ``n``
    samples of the first pass, the samples answer the prompts again from the first."""
    sizes = rounds if rounds is not None else [n_samples]
    if sum(sizes) != n_samples:
        raise DataError(f"rounds of {sizes} samples are not the run's {n_samples}")
    cycle = n_prompts if n_prompts else None
    samples = [SampleRef(sid, (sid // n) % cycle if cycle else sid // n) for sid in range(n_samples)]
    shards, start = [], 0
    for size in sizes:
        shards += [samples[i : min(i + shard_size, start + size)] for i in range(start, start + size, shard_size)]
        start += size
    return shards


@dataclass
class RolloutInputs:
    """What sampling needs beyond the run directory: the engine and the tokenized prompts."""

    entry: EngineEntry
    prompts: list[Prompt]
    stop_token_ids: list[int]
    model_len: int  # the checkpoint's context length


@dataclass
class RunContext:
    """What the stages of one run share: the checked spec, the run directory and its record, and
    (a run that samples here) its rollout inputs."""

    spec: ProbeSpec
    out: Path
    record: RunRecord
    progress: Progress
    model_path: Path
    shards: list[list[SampleRef]]
    t_start: float
    resuming: bool = False  # a run directory with an earlier invocation's record
    earlier_rollouts_from: str | None = None  # the run it adopted rollouts from, relative to ``out``
    inputs: RolloutInputs | None = None  # None: a run opened from its directory, which cannot sample
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def timings(self) -> dict[str, float]:
        return self.record.timings

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, loaded when first needed."""
        if self._tokenizer is None:
            from mismatch_probe.modeling.loading import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path, trust_remote_code=self.spec.trust_remote_code)
        return self._tokenizer

    def save(self) -> None:
        self.record.write(self.out)

    def missing(self, directory: str) -> list[int]:
        d = self.out / directory
        return [i for i in range(len(self.shards)) if not (d / shard_name(i)).is_file()]

    def fail(self, exc: BaseException) -> None:
        """Record why the run stopped (it resumes from what is on disk)."""
        self.record.stopped_by(exc)
        self.save()

    def finish_invocation(self) -> None:
        """Record the time this invocation took so far (a later stage adds to it) and save."""
        self.timings["total_s"] = round(time.perf_counter() - self.t_start, 3)
        self.save()


@contextmanager
def timed(timings: dict, key: str) -> Iterator[None]:
    """Add the block's wall time to ``timings[key]`` (seconds), even when it raises."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = round(timings.get(key, 0.0) + time.perf_counter() - t0, 3)


def default_out_dir(spec: ProbeSpec) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = spec.name or f"{Path(str(spec.model)).name}-{spec.engine.name}"
    return Path("reports") / f"{name}-{stamp}"


def same_spec(record: RunRecord, spec: ProbeSpec) -> bool:
    """Was ``record``'s run made with ``spec``? Its fingerprint is compared by the rules of the
    schema that computed it, so a run recorded by an earlier version still resumes."""
    return record.spec_fingerprint == spec.fingerprint(record.fingerprint_schema)


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


def new_record(
    spec: ProbeSpec,
    *,
    previous: RunRecord | None = None,
    fingerprint_schema: int = FINGERPRINT_SCHEMA,
    rollout_fingerprint: str | None = None,
    **sections: Any,
) -> RunRecord:
    """A run's record as its first stage writes it (``status: running``): the spec and its
    fingerprints (by ``fingerprint_schema``'s rules; ``rollout_fingerprint`` when the rollouts are
    another run's), the environment, ``sections``; a resumed run keeps its creation time and what
    its earlier invocation learned about its engine and reference."""
    from mismatch_probe.environment import fingerprint

    carried = {key: getattr(previous, key, None) for key in CARRIED_SECTIONS}
    return parse_record(
        {
            "schema_version": SCHEMA_VERSION,
            "probe_version": __version__,
            "status": "running",
            "created_at": previous.created_at if previous is not None and previous.created_at else now(),
            "spec": spec.to_dict(),
            "spec_file": spec.given_paths.get("spec_file"),
            "fingerprint_schema": fingerprint_schema,
            "spec_fingerprint": spec.fingerprint(fingerprint_schema),
            "rollout_fingerprint": rollout_fingerprint or spec.rollout_fingerprint(fingerprint_schema),
            "environment": fingerprint(),
            **carried,
            "timings": {},
            **sections,
        }
    )


def create_run(
    spec: ProbeSpec,
    out: Path,
    *,
    model_path: Path,
    shards: list[list[SampleRef]],
    overwrite: bool = False,
    progress: Progress | None = None,
    same_run: Callable[[RunRecord], bool] | None = None,
    other: str = "a run with a different spec",
    t_start: float | None = None,
    **record: Any,
) -> RunContext:
    """Create the run directory ``out`` (or resume the run in it) and write its first record
    (:func:`new_record` with ``record``'s arguments); the context the stages take from there.
    ``same_run`` recognises the run a directory may already hold (default: the same spec)."""
    previous = prepare_out_dir(out, same_run or (lambda earlier: same_spec(earlier, spec)), other, overwrite=overwrite)
    ctx = RunContext(
        spec=spec,
        out=out,
        record=new_record(spec, previous=previous, **record),
        progress=progress or Progress(),
        model_path=model_path,
        shards=shards,
        t_start=time.perf_counter() if t_start is None else t_start,
        resuming=previous is not None,
        earlier_rollouts_from=previous.rollouts_source().run if previous is not None else None,
    )
    ctx.save()
    return ctx


def open_run(run_dir: str | Path, *, progress: Progress | None = None, model: str | Path | None = None) -> RunContext:
    """The context of an existing run directory, from its record alone (no prompts file, no engine):
    what ``score`` and ``analyze`` run on. ``model`` replaces the checkpoint path the record names
    (relative to the working directory it ran in), e.g. when scoring on another machine."""
    from mismatch_probe.modeling.loading import check_model_dir

    out = Path(run_dir)
    record = read_record(out, "run directory", require_complete=False)
    spec = recorded_spec(record, out, model)
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
    shards = shard_samples(
        inputs.n_samples, spec.sampling.n, spec.shard_size, n_prompts=inputs.n_prompts, rounds=inputs.round_samples
    )
    if len(shards) != inputs.n_shards:
        raise DataError(
            f"{out}/run.json: {inputs.n_samples} samples in shards of {spec.shard_size} are not {inputs.n_shards} shards"
        )
    return RunContext(
        spec=spec,
        out=out,
        record=record,
        progress=progress or Progress(),
        model_path=model_path,
        shards=shards,
        t_start=time.perf_counter() - record.timings.get("total_s", 0.0),
        resuming=True,
    )


def recorded_spec(record: RunRecord, out: Path, model: str | Path | None) -> ProbeSpec:
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


def require_shards(ctx: RunContext, directory: str, what: str, stage: str) -> None:
    """Refuse a stage whose input shards are not all there, naming the stage that makes them."""
    missing = ctx.missing(directory)
    if missing:
        raise ConfigError(
            f"{ctx.out} has {len(ctx.shards) - len(missing)} of {len(ctx.shards)} {what} shards",
            hint=f"finish it first: {stage}",
        )
