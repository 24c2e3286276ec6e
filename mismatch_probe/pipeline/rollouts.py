"""Rollout plumbing of the sample stage: shards of samples through an engine (and its prefill),
the log-prob semantics recorded with them, and rollouts adopted from another run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import ProbeSpec, rollout_fingerprint
from mismatch_probe.engines.base import Engine, ScoreRequest, prefill_scorer
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.files import atomic_path, relative_to_dir
from mismatch_probe.modeling.logprobs import LogprobSemantics, reference_semantics
from mismatch_probe.pipeline.runs import RunContext, SampleRef, timed
from mismatch_probe.record import RunRecord, read_record
from mismatch_probe.rollout.prompts import Prompt
from mismatch_probe.table.tokens import (
    RECEIVED_DIR,
    ROLLOUTS_DIR,
    Rollout,
    rollouts_to_table,
    shard_name,
    write_table_atomic,
)

# what a run that adopts another's rollouts takes from that run's record
ADOPTED_FIELDS = (
    "engine",
    "engine_process",
    "decode_vs_prefill",
    "tokenization_check",
    "server_template_check",
    "imported_from",
    "precision",  # an adaptive run's rounds: the adopting run has the same samples
)


def sample_shards(
    ctx: RunContext, engine: Engine, missing: list[int], *, workarounds_before: dict | None = None
) -> dict:
    """Sample the missing rollout shards (and re-score them with the engine's prefill). Returns how
    often each engine workaround had applied before this engine started (what its counts add to),
    for a caller that samples with the same engine again (an adaptive run's next round) to pass
    back as ``workarounds_before``."""
    from mismatch_probe.rollout.multiturn import (
        RetokenizationCheck,
        ServerTemplateCheck,
        ToolTurnTemplate,
        roll_out,
    )

    if ctx.inputs is None:
        raise ConfigError(
            f"{ctx.out} was opened from its directory; sample it with its spec", hint="mismatch-probe sample SPEC"
        )
    spec, record, shards, progress = ctx.spec, ctx.record, ctx.shards, ctx.progress
    prompts = ctx.inputs.prompts
    rollout_dir, tokenizer = ctx.out / ROLLOUTS_DIR, ctx.tokenizer
    semantics = engine.semantics(spec.sampling)
    s = spec.sampling
    info = engine.info()
    if info.get("version_warning"):  # an engine release outside the adapter's supported range (engines/api_uses.py)
        progress.log(f"warning: {info['version_warning']}")
    prefill_skip = prefill_skip_reason(spec, engine, semantics)
    renders = info.get("renders_prompts")  # the server renders chat messages itself (swift rollout)
    if renders:
        no_chat = next(
            (prompts[x.prompt_index] for shard in shards for x in shard if not prompts[x.prompt_index].messages), None
        )
        if no_chat is not None:
            raise ConfigError(
                f"prompt {no_chat.id!r} (line {no_chat.line}) has no chat messages, but {renders} takes chat "
                "messages only and renders them with its own template",
                hint='give every prompt as "messages" in the prompts file',
            )
    sampled_before = len(missing) < len(shards) or (rollout_dir / RECEIVED_DIR).is_dir()
    # what an earlier invocation of this run worked around (engine.workarounds): counts add up
    worked_around = (
        dict(workarounds_before)
        if workarounds_before is not None
        else dict((record.engine.to_dict().get("workarounds") if sampled_before and record.engine else None) or {})
    )
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
            "logprob_semantics": semantics_record(spec, semantics, prefill=prefill_skip is None),
            "decode_vs_prefill": {"skipped": prefill_skip} if prefill_skip else None,
        }
    )
    ctx.save()
    progress.stage("generate", sum(len(shards[i]) for i in missing))
    if prefill_skip is None:
        progress.stage("prefill", sum(len(shards[i]) for i in missing))
    replay = any(prompts[x.prompt_index].recorded for shard in shards for x in shard)
    check, previous_check = RetokenizationCheck(), record.tokenization_check
    server_check = ServerTemplateCheck() if renders else None
    previous_server_check = record.server_template_check if sampled_before else None
    template = ToolTurnTemplate.from_tokenizer(tokenizer) if spec.max_turns > 1 or replay else None
    for i in missing:
        shard = shards[i]
        with timed(ctx.timings, "generation_s"):
            conversations = roll_out(
                engine,
                [prompts[x.prompt_index].token_ids for x in shard],
                [x.sample_id for x in shard],
                s,
                stop_token_ids=ctx.inputs.stop_token_ids,
                seed=s.seed * 1_000_003 + i,
                max_turns=spec.max_turns,
                max_model_len=ctx.inputs.model_len,
                tokenizer=tokenizer,
                template=template,
                recorded=[prompts[x.prompt_index].recorded for x in shard],
                messages=[prompts[x.prompt_index].messages for x in shard] if renders else None,
                server_template=server_check,
                on_progress=lambda k: progress.advance("generate", k),
            )
        rollouts = [to_rollout(x, prompts[x.prompt_index], c) for x, c in zip(shard, conversations)]
        if template is not None:
            for x, c in zip(shard, conversations):
                check.add(c, prompts[x.prompt_index].messages, tokenizer)
        if prefill_skip is None:
            n_prompt = [len(c.ids[0]) for c in conversations]  # the prompt as the engine saw it
            with timed(ctx.timings, "prefill_s"):
                scored = prefill_scorer(engine).prefill_logprobs(
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
        if server_check is not None:
            record.server_template_check = server_check.merge(previous_server_check)
        if template is not None or server_check is not None:
            ctx.save()
    if info.get("workarounds"):  # how often each applied, this invocation's added to the earlier ones'
        done = engine.info().get("workarounds") or {}
        for key, now in done.items():
            before = worked_around.get(key) or {}
            if "restored" in now:  # a count (a workaround of a setting has none)
                done[key] = {**now, "restored": int(now["restored"]) + int(before.get("restored", 0))}
        record.update_sections({"engine": {**info, "workarounds": done}})
        ctx.save()
    return worked_around


def prefill_skip_reason(spec: ProbeSpec, engine: Engine, semantics: LogprobSemantics) -> str | None:
    """Why the decode-vs-prefill check does not run, or None when it does."""
    if not spec.engine.prefill_check:
        return "turned off (engine.prefill_check = false)"
    if not engine.capabilities.prefill:
        return engine.capabilities.why_no_prefill(spec.engine.name)
    if semantics.transforms_logits:
        return (
            f"the engine returns processed log-probs ({semantics.describe()['distribution']}) but prefill "
            "log-probs are raw, so the two are not comparable; use logprobs_mode = raw to see it"
        )
    return None


def to_rollout(sample: SampleRef, prompt: Prompt, conversation) -> Rollout:
    """One sampled conversation as the rollout shard row it becomes."""
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


def semantics_record(spec: ProbeSpec, engine: LogprobSemantics, *, prefill: bool) -> dict:
    """run.json's ``logprob_semantics``: the engine's distribution, the reference's (``reference.logprobs``)
    and whether they are the same one."""
    s = spec.sampling
    ref = reference_semantics(spec.reference.logprobs, engine, s.temperature, s.top_k, s.top_p)
    return {
        "engine": engine.describe(),
        "reference": ref.describe(),
        "matched": ref.distribution() == engine.distribution(),
        "prefill": {"mode": "raw", "distribution": "log_softmax(logits)"} if prefill else None,
    }


def adopt_rollouts(
    spec: ProbeSpec, source: Path, record: RunRecord, n_shards: int, rollout_dir: Path, *, check: bool = True
) -> None:
    """Take ``source``'s rollout shards (hard links where the file system allows) and what it
    recorded about its engine, after checking they were sampled exactly as ``spec`` would
    (``check=False``: ``spec`` was derived from that run's own record, see ``commands.score``)."""
    theirs = read_record(source, "--rollouts-from", require_complete=False)
    # computed from absolute paths when that run started (older records: from their spec, which held them)
    theirs_fingerprint = theirs.rollout_fingerprint or rollout_fingerprint(theirs.spec.to_dict())
    if check and theirs_fingerprint != spec.rollout_fingerprint(theirs.fingerprint_schema):
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
            "logprob_semantics": semantics_record(
                spec, LogprobSemantics.from_record(engine_semantics.to_dict()), prefill=prefill
            ),
            "rollouts_from": {
                "run": relative_to_dir(source, rollout_dir.parent),
                "spec_fingerprint": theirs.spec_fingerprint,
            },
        }
    )
