"""Adaptive sample size (``sampling.precision``): the sample stage in rounds, each scored as it comes,
until K3's interval is as tight as asked or a budget is spent.

The first round is the run's prompts x n samples. After each round the reference scores its shards
(loaded in this process beside the engine's worker, which stays up between rounds), K3's 95%
sequence-bootstrap interval is computed over every sequence so far (``analysis/precision.py``), and
the next round's size is decided and written to run.json *before* it is sampled: ``inputs.round_samples``
(the rounds' sizes, from which :func:`~mismatch_probe.pipeline.runs.shard_samples` gives the shards)
and ``precision`` (each round's interval and the decision). Seeds come from the shard index, so a run
killed at any point resumes to the same rounds: the rounds already decided are read back, a round's
missing shards are sampled with the seeds they had, and a decision not yet written is taken again
from the same tokens (only ``time_budget`` reads the clock; a resumed run counts the time it spent
before the kill as its record says).

The engine and the reference are each started only when a shard needs them: a run killed after its
last round was sampled and scored finishes without either.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from mismatch_probe.analysis.intervals import RUN_LEVEL, RUN_N_BOOT, RUN_SEED
from mismatch_probe.analysis.precision import (
    DEFAULT_MAX_ROUNDS_OF_SAMPLES,
    Budget,
    Spent,
    k3_interval,
    next_round,
    outcome_line,
    percent,
    relative_half_width,
    sequence_k3,
)
from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.engines.base import Engine
from mismatch_probe.errors import ConfigError
from mismatch_probe.pipeline.runs import RunContext, shard_samples, timed
from mismatch_probe.table.tokens import ROLLOUTS_DIR, TOKENS_DIR, read_model_tokens, shard_name


def is_adaptive(spec: ProbeSpec) -> bool:
    return spec.sampling.precision is not None


def budget_of(spec: ProbeSpec, n_prompts: int) -> Budget:
    """What the rounds may spend: ``sampling.max_samples`` (default 10x the prompts x n), tokens, seconds."""
    s = spec.sampling
    return Budget(s.max_samples or DEFAULT_MAX_ROUNDS_OF_SAMPLES * n_prompts * s.n, s.token_budget, s.time_budget)


def first_round(spec: ProbeSpec, n_prompts: int) -> int:
    """The first round: the prompts x n samples, or fewer whole groups of n when max_samples is lower."""
    n = spec.sampling.n
    cap = budget_of(spec, n_prompts).samples
    return min(n_prompts * n, max(n, cap // n * n))


def plan_rounds(ctx: RunContext, source_rounds: list[int] | None = None) -> None:
    """Set the shards of an adaptive run (in prepare, once the run directory exists): the rounds a
    resumed run already decided, those of the run whose rollouts it adopts (``source_rounds``), or
    the first round alone."""
    spec, inputs = ctx.spec, ctx.record.inputs
    assert inputs is not None and inputs.n_prompts is not None  # prepare records them
    state = ctx.record.precision  # carried from the invocation that was stopped
    if source_rounds is not None:
        rounds = list(source_rounds)
    elif state and state.get("rounds"):
        rounds = planned(state)
    else:
        rounds = [first_round(spec, inputs.n_prompts)]
    set_rounds(ctx, rounds)


def planned(state: dict[str, Any]) -> list[int]:
    """The rounds' sizes so far: each decided round's, and the next one's once decided."""
    return [int(r["samples"]) for r in state["rounds"]] + (
        [int(state["next_round"])] if state.get("next_round") else []
    )


def set_rounds(ctx: RunContext, rounds: list[int]) -> None:
    inputs = ctx.record.inputs
    assert inputs is not None and inputs.n_prompts is not None
    ctx.shards = shard_samples(
        sum(rounds), ctx.spec.sampling.n, ctx.spec.shard_size, n_prompts=inputs.n_prompts, rounds=rounds
    )
    inputs.round_samples, inputs.n_samples, inputs.n_shards = list(rounds), sum(rounds), len(ctx.shards)


def round_shards(rounds: list[int], shard_size: int) -> list[range]:
    """The shard indices of each round (each round in shards of its own)."""
    out, start = [], 0
    for size in rounds:
        k = -(-size // shard_size)
        out.append(range(start, start + k))
        start += k
    return out


def sample_in_rounds(
    ctx: RunContext,
    engine: Callable[[], Engine],
    sample_shards: Callable[..., Any],
    open_reference: Callable[[RunContext], Any],
) -> None:
    """The sample stage of an adaptive run: round after round, sample (``engine()`` starts the engine
    when first needed), score (``open_reference``, a context manager, loaded when first needed),
    compute K3's interval and decide the next round, until the target is met or a budget is spent.
    ``precision`` in run.json holds every round and the outcome."""
    spec, record = ctx.spec, ctx.record
    inputs = record.inputs
    assert inputs is not None and inputs.round_samples is not None and inputs.n_prompts is not None
    target = float(spec.sampling.precision or 0.0)
    budget = budget_of(spec, inputs.n_prompts)
    state = _fresh_state(target, budget) if not record.precision else dict(record.precision)
    done = list(state.get("rounds") or [])
    k3_sum: list[np.ndarray] = []
    n_tokens: list[np.ndarray] = []
    seconds = float(done[-1]["seconds_total"]) if done else 0.0
    workarounds = None  # the engine's workaround counts before this invocation (sample_shards adds to them)
    with ExitStack() as stack:
        reference = None
        r = 0
        while r < len(inputs.round_samples):
            rounds = inputs.round_samples
            shards = round_shards(rounds, spec.shard_size)[r]
            t0 = _round_time(ctx)
            if missing := [i for i in shards if not (ctx.out / ROLLOUTS_DIR / shard_name(i)).is_file()]:
                sampler = engine()  # started on the first shard to sample (its start is logged)
                ctx.progress.log(f"round {r + 1}: sampling {_samples(ctx, missing)} samples")
                workarounds = sample_shards(ctx, sampler, missing, workarounds_before=workarounds)
            if unscored := [i for i in shards if not (ctx.out / TOKENS_DIR / shard_name(i)).is_file()]:
                if reference is None:
                    reference = stack.enter_context(open_reference(ctx))
                ctx.progress.stage("score", _samples(ctx, unscored))
                for i in unscored:
                    reference.score_shard(i)
            with timed(ctx.timings, "precision_s"):  # what rounds cost beyond sampling and scoring
                for i in shards:
                    shard = read_model_tokens(ctx.out / TOKENS_DIR / shard_name(i))
                    ks, nt = sequence_k3(shard["logp_train"], shard["logp_infer"], shard["sample_id"])
                    k3_sum.append(ks)
                    n_tokens.append(nt)
                if r < len(done):  # decided by an earlier invocation: its record stands
                    r += 1
                    continue
                seconds += _round_time(ctx) - t0
                interval = k3_interval(np.concatenate(k3_sum), np.concatenate(n_tokens))
            assert interval is not None  # every round has sequences
            relative = relative_half_width(interval)
            n_samples = sum(rounds[: r + 1])
            tokens = int(sum(int(t.sum()) for t in n_tokens))
            decision = next_round(
                relative, target, Spent(n_samples, tokens, seconds), budget, n_per_prompt=spec.sampling.n
            )
            done.append(
                {
                    "round": r + 1,
                    "samples": rounds[r],
                    "shards": len(shards),
                    "samples_total": n_samples,
                    "tokens_total": tokens,
                    "seconds_total": round(seconds, 3),
                    "k3_kl": interval.estimate,
                    "low": interval.low,
                    "high": interval.high,
                    "relative_half_width": relative,
                    "samples_needed": decision.needed,
                    "met": decision.met,
                }
            )
            state |= {"rounds": done, "next_round": decision.samples or None}
            if decision.samples:
                ctx.progress.log(
                    f"round {r + 1}: K3 {interval.estimate:.3g} ±{percent(relative)} on {n_samples} samples "
                    f"(target ±{percent(target)}); next round: {decision.samples} samples"
                )
            else:
                state |= {
                    "met": decision.met,
                    "stop": decision.stop,
                    "samples_needed": decision.needed,
                    "more_samples_needed": None if decision.needed is None else max(decision.needed - n_samples, 0),
                }
                ctx.progress.log(outcome_line(state))
            record.update_sections({"precision": state})
            set_rounds(ctx, planned(state))
            ctx.save()  # the decision and the next round's plan at once: a kill leaves both or neither
            r += 1


# what a round's time is (time_budget): sampling, the engine's prefill and the reference's scoring,
# not the engine's start nor the reference's load, which happen once whatever the number of rounds
ROUND_TIMINGS = ("generation_s", "prefill_s", "scoring_s")


def _round_time(ctx: RunContext) -> float:
    return sum(ctx.timings.get(k, 0.0) for k in ROUND_TIMINGS)


def _fresh_state(target: float, budget: Budget) -> dict[str, Any]:
    return {
        "target": target,
        "metric": "k3_kl",
        "unit": "sequence",
        "level": RUN_LEVEL,
        "n_boot": RUN_N_BOOT,
        "seed": RUN_SEED,
        "budget": {"max_samples": budget.samples, "token_budget": budget.tokens, "time_budget": budget.seconds},
        "rounds": [],
        "next_round": None,  # the samples of the round decided but not yet done
        "met": None,
        "stop": None,
        "samples_needed": None,
        "more_samples_needed": None,
    }


def _samples(ctx: RunContext, shards: list[int]) -> int:
    return sum(len(ctx.shards[i]) for i in shards)


def finished(ctx: RunContext) -> bool:
    """Has this adaptive run decided its last round (met, or stopped by a budget)?"""
    state = ctx.record.precision
    return state is not None and state.get("met") is not None


def check_adaptive(spec: ProbeSpec) -> None:
    """What an adaptive run cannot be combined with."""
    if is_adaptive(spec) and spec.sync.enabled:
        raise ConfigError(
            "sampling.precision and [sync] together: a run with [sync] samples between weight syncs, not in rounds",
            hint="drop --precision, or run the sync probe with a fixed sample count",
        )
