"""``mismatch-probe import``: a training framework's rollout dump as a run directory.

The run an RL job already made is the one worth diagnosing. A reader (``dumps/``) streams the
dump's samples; each is checked against the checkpoint (:func:`dumps.samples.to_rollout`) and
written as the rollout shards ``sample`` writes, so every later stage runs on it unchanged:

- with the trainer's log-probs in the dump, the token shards too, with the trainer in the
  reference's place: ``analyze DIR`` then shows what the run itself saw (engine vs its trainer);
- ``score DIR`` (no trainer log-probs) or ``score DIR --out NEW --set reference.x=y`` re-scores the
  same tokens with this tool's reference, and the trainer's log-probs ride along in the table, so
  the analysis separates "engine vs an ideal forward" from "engine vs your trainer" (``trainer``).

Imports stream (one file and one shard in memory) and resume: shards are written atomically and a
re-run with the same dump and options keeps the shards already there. See ARCHITECTURE.md,
"Imported runs".
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.config.spec import FINGERPRINT_SCHEMA, EngineSpec, ProbeSpec, flag_of, spec_settings
from mismatch_probe.config.spec_reading import apply_overrides
from mismatch_probe.dumps import SAMPLED_SETTINGS, DumpFormat, get_format, open_dump
from mismatch_probe.dumps.base import DumpReader
from mismatch_probe.dumps.samples import Checked, to_rollout
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import portable_path
from mismatch_probe.modeling.logprobs import engine_semantics, reference_semantics
from mismatch_probe.pipeline.runs import Progress, RunContext, create_run, open_run
from mismatch_probe.record import RunRecord, find_record
from mismatch_probe.table.tokens import (
    ROLLOUTS_DIR,
    TOKENS_DIR,
    rollouts_to_table,
    shard_name,
    token_table,
    write_table_atomic,
)

TRAINER_LOGPROBS = ("raw", "temperature", "processed")


@dataclass
class ImportOptions:
    """How to read the dump and what it was sampled with (what the dump cannot say itself)."""

    # spec settings given as `import`'s flags, by key: what the run sampled with (SAMPLED_SETTINGS,
    # which default to the dump's) and its [reference] / [corrections] settings
    flags: dict[str, Any] = field(default_factory=dict)
    trainer_logprobs: str | None = None  # raw | temperature | processed (default: the format's)
    step: int | None = None
    trust_pickle: bool = False
    trainer_path: str | None = None  # slime: its train dump, when not in train_data/ beside the rollouts
    use_trainer: bool = True  # False: import the engine side only, to score with the reference
    shard_size: int = 256
    trust_remote_code: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # [reference] / [corrections] settings (--set)


@dataclass
class _Tally:
    """What the streamed samples add up to (the record's inputs and imported_from)."""

    samples: int = 0
    tokens: int = 0
    model_tokens: int = 0
    max_response: int = 0
    max_turns: int = 0
    prompts: set[str] = field(default_factory=set)
    trainer: bool | None = None
    experts: bool | None = None
    first_where: dict[str, str] = field(default_factory=dict)

    def add(self, checked: Checked, where: str) -> None:
        r = checked.rollout
        self.samples += 1
        self.tokens += len(r.token_ids)
        n_model = r.n_model_tokens
        self.model_tokens += n_model
        model_at = np.flatnonzero(r.is_model_token)
        self.max_response = max(self.max_response, int(len(r.token_ids) - model_at[0]) if n_model else 0)
        self.max_turns = max(self.max_turns, int(r.turn.max()) + 1 if n_model else 0)
        self.prompts.add(r.prompt_id)
        self._consistent("trainer", checked.logp_trainer is not None, where, "trainer log-probs")
        self._consistent("experts", r.experts_infer is not None, where, "routed experts")

    def _consistent(self, name: str, has: bool, where: str, what: str) -> None:
        seen = getattr(self, name)
        if seen is None:
            setattr(self, name, has)
            self.first_where[name] = where
        elif seen != has:
            first = self.first_where[name]
            raise ConfigError(
                f"{where} {'has' if has else 'lacks'} {what}, but {first} {'has' if seen else 'lacks'} them",
                hint="every sample of a dump must have them, or none"
                + (" (--no-trainer imports the engine side alone)" if name == "trainer" else ""),
            )


def import_dump(
    format_name: str,
    path: str | Path,
    *,
    model: str | Path,
    out: str | Path | None = None,
    options: ImportOptions | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> RunContext:
    """Turn a dump into a run directory (rollouts; token shards when the trainer's log-probs are
    in it) and return its context, ready for ``score`` / ``analyze``."""
    from mismatch_probe.modeling.loading import check_model_dir, load_tokenizer, read_config, text_setting

    t0 = time.perf_counter()
    opts = options or ImportOptions()
    progress = progress or Progress()
    fmt = get_format(format_name)
    model_path = check_model_dir(str(model))
    tokenizer = load_tokenizer(model_path, trust_remote_code=opts.trust_remote_code)
    config = read_config(model_path)
    vocab_size = int(text_setting(config, "vocab_size") or len(tokenizer))
    reader = open_dump(fmt, path, step=opts.step, trust_pickle=opts.trust_pickle, trainer_path=opts.trainer_path)
    reader.want_trainer = opts.use_trainer
    if reader.tokenizer_dir is not None:
        _check_same_tokenizer(reader.tokenizer_dir, tokenizer, model_path)
    spec, sources = _spec(fmt, reader, model, path, out, opts)
    out_dir = Path(spec.out or "")
    fingerprint = _import_fingerprint(fmt, reader, opts)

    def same_import(run: RunRecord) -> bool:
        return run.import_info().fingerprint == fingerprint

    earlier = None if overwrite or not out_dir.is_dir() else find_record(out_dir)
    if earlier is not None and same_import(earlier) and earlier.import_info().samples is not None:
        # the same import, finished (and maybe analyzed since): nothing to redo, nothing to lose
        return open_run(out_dir, progress=progress, model=model_path)
    imported: dict[str, Any] = {
        "format": fmt.name,
        "path": portable_path(Path(path).resolve()),
        **reader.describe(),
        "fingerprint": fingerprint,
        "settings_from": sources,
    }
    # written now: a killed import leaves a run directory that the same command resumes
    ctx = create_run(
        spec,
        out_dir,
        model_path=model_path,
        shards=[],  # streamed: how many there are is known once they are written
        overwrite=overwrite,
        progress=progress,
        same_run=same_import,
        other="another run",
        imported_from=imported,
    )
    record = ctx.record
    try:
        written = _write_shards(reader, out_dir, spec, opts, model_path, config, vocab_size, progress)
    except BaseException as exc:  # the shards written so far stay; the same command resumes
        ctx.fail(exc)
        raise
    tally, layout = written.tally, written.layout
    if tally.samples == 0:
        raise ConfigError(f"{path} holds no samples")
    spec.sampling.max_tokens = max(tally.max_response, 1)
    spec.max_turns = max(tally.max_turns, 1)
    record = _final_record(
        spec, fmt, reader, record, imported, tally, layout, model_path, tokenizer, opts, written.shards, t0
    )
    if ctx.resuming:
        record.resumed = {"rollout_shards_reused": written.reused}
    record.write(out_dir)
    return open_run(out_dir, progress=progress, model=model_path)


@dataclass
class _Written:
    tally: _Tally
    layout: dict | None  # the checkpoint's MoE layers, when the dump has routed experts
    shards: int
    reused: int  # shards an earlier, interrupted import had written


def _write_shards(
    reader: DumpReader,
    out: Path,
    spec: ProbeSpec,
    opts: ImportOptions,
    model_path: Path,
    config: dict,
    vocab_size: int,
    progress: Progress,
) -> _Written:
    """Stream the dump's samples, checked, into shards of ``spec.shard_size`` samples."""
    written = _Written(_Tally(), None, 0, 0)
    shard: list[Checked] = []

    def flush() -> None:
        written.reused += _write_shard(out, written.shards, shard, with_tokens=bool(written.tally.trainer))
        progress.advance("import", len(shard))
        shard.clear()
        written.shards += 1

    progress.stage("import", 0)
    for k, sample in enumerate(reader.samples()):
        if not opts.use_trainer:
            sample.logp_trainer = None
        if sample.experts is not None:
            written.layout = written.layout or _routing_layout(model_path, opts.trust_remote_code)
            sample.experts = _moe_rows(sample.experts, written.layout, config)
        layout = written.layout
        checked = to_rollout(
            sample, k, vocab_size=vocab_size, num_experts=layout.get("num_experts") if layout else None
        )
        if layout is not None and checked.rollout.experts_infer is not None:
            _check_expert_width(checked.rollout.experts_infer, layout, sample.where)
        written.tally.add(checked, sample.where)
        shard.append(checked)
        if len(shard) == spec.shard_size:
            flush()
    if shard:
        flush()
    return written


def _spec(
    fmt: DumpFormat,
    reader: DumpReader,
    model: str | Path,
    path: str | Path,
    out: str | Path | None,
    opts: ImportOptions,
) -> tuple[ProbeSpec, dict[str, str]]:
    """The spec an imported run records: the checkpoint, the dump as its prompts, the engine and
    sampling settings the dump was made with (each one's source in ``sources``)."""
    sources: dict[str, str] = {}
    values: dict[str, Any] = {}
    named: dict[str, str] = {}  # how an error names each setting: the import flag, or the dump

    own_defaults = {"engine.name": fmt.engine, "engine.logprobs_mode": fmt.engine_logprobs}
    for key in SAMPLED_SETTINGS:
        if opts.flags.get(key) is not None:
            sources[key], values[key], named[key] = "flag", opts.flags[key], flag_of(key)
        elif key in reader.settings:
            sources[key], values[key], named[key] = "dump", reader.settings[key], f"the dump's {key}"
        else:
            default = own_defaults.get(key, spec_settings()[key].default)
            sources[key], values[key], named[key] = "default", default, key
    step = f"-step{reader.step}" if reader.step is not None else ""
    if out is None:
        out = Path("reports") / f"{fmt.name}{step}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if opts.shard_size < 1:
        raise ConfigError(f"--shard-size must be >= 1, got {opts.shard_size}")
    spec = ProbeSpec(
        model=str(Path(model).resolve()),
        prompts=str(Path(path).resolve()),
        out=str(out),
        name=f"{fmt.name}{step}",
        shard_size=opts.shard_size,
        engine=EngineSpec(prefill_check=False),
    )
    # the dump's values, or the flags that stand for them, checked as any setting is
    spec = apply_overrides(spec, values, named_by=lambda key: named[key])
    spec.given_paths.update({"model": str(model), "prompts": str(path), "out": str(out)})
    flags = {k: v for k, v in opts.flags.items() if k not in SAMPLED_SETTINGS}
    bad = [k for k in {**flags, **opts.overrides} if k.partition(".")[0] not in ("reference", "corrections")]
    if bad:
        raise ConfigError(
            f"import sets {', '.join(bad)}: only [reference] and [corrections] settings",
            hint="the engine and sampling settings are the dump's ("
            + ", ".join(flag_of(k) for k in SAMPLED_SETTINGS)
            + ")",
        )
    spec = apply_overrides(spec, flags)
    spec = apply_overrides(spec, opts.overrides, named_by="set")
    if opts.trainer_logprobs not in (None, *TRAINER_LOGPROBS):
        raise ConfigError(
            f"--trainer-logprobs {opts.trainer_logprobs!r}: choose one of {', '.join(TRAINER_LOGPROBS)}",
            hint="raw: log_softmax(logits); temperature: log_softmax(logits / T); processed: with top-k / top-p too",
        )
    return spec.normalized(), sources


# the names the sampled settings had as ImportOptions fields, which import fingerprints have hashed
# them by since imports existed: an import interrupted under an earlier version resumes
_FINGERPRINTED_AS = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "engine.name": "engine",
    "engine.logprobs_mode": "engine_logprobs",
}


def _import_fingerprint(fmt: DumpFormat, reader: DumpReader, opts: ImportOptions) -> str:
    """What decides an import's shards: the dump's files (name, size, modification time) and the options."""
    files = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in reader.files]
    options = {k: v for k, v in vars(opts).items() if k not in ("flags", "overrides", "trust_remote_code")}
    options |= {_FINGERPRINTED_AS[k]: opts.flags.get(k) for k in SAMPLED_SETTINGS}
    overrides = {k: v for k, v in opts.flags.items() if k not in SAMPLED_SETTINGS and v is not None} | opts.overrides
    payload = {"format": fmt.name, "files": files, "step": reader.step, "options": options, "overrides": overrides}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_shard(out: Path, index: int, shard: list[Checked], *, with_tokens: bool) -> bool:
    """Shard ``index`` of the rollouts (and, with the trainer's log-probs, of the token table with
    the trainer in the reference's place); a shard already on disk (a resumed import) is kept.
    True when it was."""
    rollouts_path, tokens_path = out / ROLLOUTS_DIR / shard_name(index), out / TOKENS_DIR / shard_name(index)
    rollouts = [c.rollout for c in shard]
    kept = rollouts_path.is_file() and (not with_tokens or tokens_path.is_file())
    if not rollouts_path.is_file():
        write_table_atomic(rollouts_to_table(rollouts), rollouts_path)
    if with_tokens and not tokens_path.is_file():
        trainer = [c.logp_trainer for c in shard if c.logp_trainer is not None]  # all of them (_Tally)
        entropy = [np.full(len(r.token_ids), np.nan, np.float32) for r in rollouts]
        write_table_atomic(token_table(rollouts, trainer, entropy), tokens_path)
    return kept


def _check_same_tokenizer(saved: Path, tokenizer: Any, model_path: Path) -> None:
    """Token ids mean something only under their tokenizer: the one the run saved with its dump
    must map every token to the id the checkpoint's does."""
    from mismatch_probe.modeling.loading import load_tokenizer

    theirs = load_tokenizer(saved).get_vocab()
    ours = tokenizer.get_vocab()
    differ = sorted(t for t in theirs.keys() | ours.keys() if theirs.get(t) != ours.get(t))
    if differ:
        raise ConfigError(
            f"the tokenizer the run saved with its dump ({saved}) and {model_path}'s differ on {len(differ)} "
            f"token(s), e.g. {differ[0]!r}: its token ids would be read as other tokens",
            hint="pass the checkpoint the run sampled with (--model)",
        )


def _routing_layout(model_path: Path, trust_remote_code: bool) -> dict:
    """The checkpoint's MoE layers as the reference records them (its routers, built on the meta device)."""
    from mismatch_probe.modeling.routing import RouterRecorder
    from mismatch_probe.modeling.sharded_loading import build_on_meta

    model = build_on_meta(model_path, dtype="float32", attn_implementation="eager", trust_remote_code=trust_remote_code)
    recorder = RouterRecorder(model)
    if not recorder.active:
        raise ConfigError(
            f"the dump has routed experts, but {model_path} has no MoE router",
            hint="pass the MoE checkpoint the run sampled from (--model)",
        )
    return recorder.describe(model)


def _moe_rows(experts: np.ndarray, layout: dict, config: dict) -> np.ndarray:
    """The MoE layers' routing, when a dump records every decoder layer (slime's R3 is
    ``[positions, num_layers, top-k]``; a dense layer's rows are padding)."""
    from mismatch_probe.modeling.loading import text_setting

    n_layers = text_setting(config, "num_hidden_layers")
    moe = layout["moe_layers"]
    if experts.ndim == 3 and experts.shape[1] == n_layers != len(moe):
        return experts[:, moe, :]
    return experts


def _check_expert_width(experts: np.ndarray, layout: dict, where: str) -> None:
    layers, k = len(layout["moe_layers"]), layout["top_k"]
    if experts.shape[1:] != (layers, k):
        raise ConfigError(
            f"{where}: routed experts are [{experts.shape[1]} layers x top-{experts.shape[2]}]; "
            f"the checkpoint routes {layers} MoE layers x top-{k}"
        )


def _final_record(
    spec: ProbeSpec,
    fmt: DumpFormat,
    reader: DumpReader,
    record: RunRecord,
    imported: dict[str, Any],
    tally: _Tally,
    layout: dict | None,
    model_path: Path,
    tokenizer: Any,
    opts: ImportOptions,
    n_shards: int,
    t0: float,
) -> RunRecord:
    """The record of a finished import: every section the later stages read."""
    from mismatch_probe.environment import fingerprint
    from mismatch_probe.modeling.architecture import describe_checkpoint
    from mismatch_probe.modeling.loading import stop_token_ids

    s = spec.sampling
    engine = engine_semantics(spec.engine.logprobs_mode or "raw", s.temperature, s.top_k, s.top_p)  # set by validate()
    trainer = bool(tally.trainer)
    if trainer:
        choice = opts.trainer_logprobs or fmt.trainer_logprobs
        ref = reference_semantics(choice, engine, s.temperature, s.top_k, s.top_p)
    else:
        ref = reference_semantics(spec.reference.logprobs, engine, s.temperature, s.top_k, s.top_p)
    imported.update(
        samples=tally.samples,
        tokens=tally.tokens,
        model_tokens=tally.model_tokens,
        trainer_logprobs=trainer,
        routed_experts=bool(tally.experts),
        notes=list(reader.notes),
    )
    source = f"{fmt.name} dump" + (f" (step {reader.step})" if reader.step is not None else "")
    engine_info: dict[str, Any] = {"engine": spec.engine.name, "source": source, "versions": {}}
    if layout is not None:
        engine_info["routing"] = layout
    sections = {
        "spec": spec.to_dict(),
        "fingerprint_schema": FINGERPRINT_SCHEMA,
        "spec_fingerprint": spec.fingerprint(),
        "rollout_fingerprint": spec.rollout_fingerprint(),
        "environment": fingerprint(),
        "inputs": {
            "model": portable_path(model_path),
            "prompts": imported["path"],
            "n_prompts": len(tally.prompts),
            "n_samples": tally.samples,
            "n_shards": n_shards,
            "stop_token_ids": stop_token_ids(model_path, tokenizer),
        },
        "architecture": describe_checkpoint(model_path, trust_remote_code=opts.trust_remote_code),
        "engine": engine_info,
        "reference": {"source": "trainer", "framework": fmt.name, "from": "the dump's own log-probs"}
        if trainer
        else None,
        "logprob_semantics": {
            "engine": engine.describe(),
            "reference": ref.describe(),
            "matched": ref.distribution() == engine.distribution(),
            "prefill": None,
        },
        "decode_vs_prefill": {"skipped": f"imported from a {fmt.name} dump: its engine did not re-score the rollouts"},
        "imported_from": imported,
        "timings": {"import_s": round(time.perf_counter() - t0, 3)},
    }
    record.update_sections(sections)
    return record
