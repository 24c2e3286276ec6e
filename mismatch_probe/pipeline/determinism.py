"""Determinism and batch invariance: the same tokens scored in other batch compositions, and the
same prompts sampled twice with one seed. How far a side is from giving the same log-probs for the
same tokens, the floor under every mismatch the probe reports.

The sweep measures its baseline engine with :func:`engine_determinism`
(``determinism.json``); ``benchmarks/bench_determinism.py`` measures the engine and the reference
(:func:`reference_batch_invariance`) on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mismatch_probe.analysis.sweep import compare_logprobs
from mismatch_probe.config.spec import SamplingSpec
from mismatch_probe.table.tokens import Rollout


def first_scored(rollout: Rollout) -> int:
    """Index of the rollout's first scored token (its prompt ends just before it)."""
    scored = np.flatnonzero(np.asarray(rollout.turn) >= 0)
    return int(scored[0]) if len(scored) else len(rollout.token_ids) - 1


def _interleaved(chosen: Sequence[Any], others: Sequence[Any]) -> list[Any]:
    """The chosen items reversed, each followed by one that was not among them: other neighbours."""
    mixed: list[Any] = []
    for i, item in enumerate(reversed(chosen)):
        mixed.append(item)
        if i < len(others):
            mixed.append(others[i])
    return mixed


def engine_determinism(
    engine,
    chosen: Sequence[Rollout],
    others: Sequence[Rollout],
    sampling: SamplingSpec,
    *,
    stop_token_ids: Sequence[int] = (),
    engine_name: str = "engine",
) -> dict[str, Any]:
    """The engine's prefill of ``chosen`` twice in one batch, each one alone, and reversed among
    ``others``; then its samples of the same prompts twice with one seed."""
    from mismatch_probe.engines import GenerationRequest, ScoreRequest

    result: dict[str, Any] = {"n_sequences": len(chosen)}
    if not engine.capabilities.prefill:
        result["prefill"] = None
        result["prefill_skipped"] = engine.capabilities.why_no_prefill(engine_name)
    elif chosen:
        requests = [ScoreRequest(r.token_ids, first_scored(r)) for r in chosen]
        neighbours = [ScoreRequest(r.token_ids, first_scored(r)) for r in others]
        batched = engine.prefill_logprobs(requests)
        again = engine.prefill_logprobs(requests)
        alone = [engine.prefill_logprobs([q])[0] for q in requests]
        mixed_requests = _interleaved(requests, neighbours)
        mixed = engine.prefill_logprobs(mixed_requests)
        position = {id(q): i for i, q in enumerate(mixed_requests)}
        result["prefill"] = {
            "same_batch_twice": compare_logprobs(batched, again),
            "alone_vs_batched": compare_logprobs(batched, alone),
            "other_neighbours_vs_batched": compare_logprobs(batched, [mixed[position[id(q)]] for q in requests]),
        }
        result["batch_sizes"] = {"batched": len(requests), "alone": 1, "other_neighbours": len(mixed_requests)}
    # sampling twice with the same seed: the same tokens? their log-probs bitwise equal?
    prompts = [np.asarray(r.token_ids[: first_scored(r)], np.int32) for r in chosen]
    if prompts:
        gen = [GenerationRequest(p, sampling.max_tokens) for p in prompts]
        first = engine.generate(gen, sampling, stop_token_ids=list(stop_token_ids), seed=sampling.seed)
        second = engine.generate(gen, sampling, stop_token_ids=list(stop_token_ids), seed=sampling.seed)
        pairs = [(a, b) for a, b in zip(first, second) if np.array_equal(a.token_ids, b.token_ids)]
        info = engine.info()
        if info.get("per_request_seeds") is False:  # vLLM's CPU build: one engine-wide generator
            why = info.get("per_request_seeds_off_because") or "the engine does not seed requests"
            result["same_seed_note"] = (
                "this engine draws every sample from one engine-wide generator, so a seed does not "
                f"repeat a sample ({why})"
            )
        result["same_seed"] = {
            "n_samples": len(first),
            "identical_tokens_share": len(pairs) / len(first),
            **compare_logprobs([a.logprobs for a, _ in pairs], [b.logprobs for _, b in pairs]),
        }
    return result


def reference_batch_invariance(scorer, chosen: Sequence[Rollout], others: Sequence[Rollout], semantics) -> dict:
    """The reference's log-probs of ``chosen`` scored twice in one call, each one alone, and
    reversed among ``others`` (a packed micro-batch holds other sequences then)."""

    def scored(scores, rollouts) -> list[np.ndarray]:
        return [lp[r.is_model_token] for lp, r in zip(scores.logp, rollouts)]

    chosen = list(chosen)
    batched = scored(scorer.score(chosen, semantics), chosen)
    again = scored(scorer.score(chosen, semantics), chosen)
    alone = [scored(scorer.score([r], semantics), [r])[0] for r in chosen]
    mixed_rollouts = _interleaved(chosen, list(others))
    mixed = scored(scorer.score(mixed_rollouts, semantics), mixed_rollouts)
    position = {id(r): i for i, r in enumerate(mixed_rollouts)}
    return {
        "n_sequences": len(chosen),
        "same_batch_twice": compare_logprobs(batched, again),
        "alone_vs_batched": compare_logprobs(batched, alone),
        "other_neighbours_vs_batched": compare_logprobs(batched, [mixed[position[id(r)]] for r in chosen]),
    }
