"""What every dump reader yields, and the checks that turn it into a rollout.

A reader (``dumps/slime.py``, ``nemo_rl.py``, ``verl.py``, ``prime_rl.py``, ``generic.py``) aligns
a framework's own fields to one sequence of tokens, :class:`DumpSample`; :func:`to_rollout` checks
it (token ids in the checkpoint's vocabulary, one log-prob per model token, finite log-probs,
turns, expert ids) and returns the :class:`~mismatch_probe.table.tokens.Rollout` the engine would
have produced, plus the trainer's log-probs when the dump has them; :func:`check_step_has_model_tokens`
refuses a step with nothing to compare. Every error names the sample (file and index).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from mismatch_probe.errors import ConfigError
from mismatch_probe.table.tokens import Rollout

# a log-prob is <= 0; engines' bf16/fp16 arithmetic can round a near-certain token's just above it
LOGP_ROUNDING = 1e-3


@dataclass
class DumpSample:
    """One sequence as a training framework dumped it, aligned to its tokens.

    ``where`` ("rollout_data/7.pt, sample 12") is named in every error about the sample. Arrays of
    per-token values are full length (one per token) with the value of token t at t; values off
    model tokens are ignored. ``experts`` row i is the routing of input position i (what the
    engine computed while reading token i, which shaped the probability of token i + 1)."""

    where: str
    token_ids: np.ndarray  # full sequence: prompt, responses, tool outputs; padding stripped
    model_mask: np.ndarray  # bool, full length: the tokens the policy sampled
    logp_engine: np.ndarray  # full length
    logp_trainer: np.ndarray | None = None  # full length
    turn: np.ndarray | None = None  # full length, -1 off model tokens; None: from the mask
    experts: np.ndarray | None = None  # int [len(tokens) - 1 or len(tokens), moe layers, k]
    prompt_id: str | None = None
    finish_reason: str | None = None


@dataclass
class FlatSamples:
    """Samples laid end to end, as Arrow lays out lists: sample ``i``'s tokens are
    ``token_ids[offsets[i]:offsets[i + 1]]`` (and ``model_mask``'s), its log-probs
    ``logp_engine[engine_offsets[i]:engine_offsets[i + 1]]`` (one per token or one per model token,
    as a :class:`DumpSample`'s), the trainer's likewise."""

    offsets: np.ndarray
    token_ids: np.ndarray
    model_mask: np.ndarray  # bool
    logp_engine: np.ndarray
    engine_offsets: np.ndarray
    logp_trainer: np.ndarray
    trainer_offsets: np.ndarray


@dataclass
class SampleColumns:
    """A batch of ``n`` samples: ``samples`` gives them as :class:`DumpSample` objects, one at a
    time (the path that names a bad row); ``flat``, where every row has the plain form (no null
    where a value is needed, lists of numbers, no turns given, the trainer's log-probs), the same
    rows as flat columns."""

    n: int
    samples: Callable[[], Iterator[DumpSample]]
    flat: FlatSamples | None = None


def infer_turns(model_mask: np.ndarray) -> np.ndarray:
    """Assistant-turn index of every token from the mask alone: each run of model tokens is one
    turn (0 = the first), everything else -1. A tool's output between two runs ends a turn."""
    mask = np.asarray(model_mask, dtype=bool)
    return np.where(mask, runs_begun(mask) - 1, -1).astype(np.int16)


def runs_begun(model_mask: np.ndarray) -> np.ndarray:
    """Per token, how many runs of model tokens have begun up to and including it (int64: over
    many samples' masks laid end to end it counts past int16)."""
    mask = np.asarray(model_mask, dtype=bool)
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    return np.cumsum(starts, dtype=np.int64)


def sampled_logp_ok(on: np.ndarray) -> bool:
    """The rule for the log-probs of sampled tokens: every one finite and <= 0 (to LOGP_ROUNDING)."""
    if not len(on):
        return True
    low, high = on.min(), on.max()  # NaN propagates to both
    return bool(np.isfinite(low) and high <= LOGP_ROUNDING)


def prompt_key(token_ids: np.ndarray, model_mask: np.ndarray) -> str:
    """A prompt id for a dump that names none: the hash of the tokens before the first sampled one
    (a GRPO group's samples share it)."""
    first = int(np.argmax(model_mask)) if model_mask.any() else len(model_mask)
    return hashlib.sha1(np.ascontiguousarray(token_ids[:first], dtype="<i8").tobytes()).hexdigest()[:12]


def scatter_to_full(values, model_mask: np.ndarray, what: str, where: str) -> np.ndarray:
    """Per-token ``values`` as a full-length float64 array: given full length (one per token), or
    one per model token (placed at the model tokens). Any other count is refused."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    n, n_model = len(model_mask), int(np.count_nonzero(model_mask))
    if len(v) == n:
        return v
    if len(v) == n_model:
        full = np.full(n, np.nan)
        full[model_mask] = v
        return full
    raise ConfigError(
        f"{where}: {len(v)} {what} for {n_model} model tokens ({n} tokens in all)",
        hint="the dump's log-probs must be one per model token, or one per token",
    )


NO_MODEL_TOKENS_HINT = (
    "the dump's mask of sampled tokens must be 1 on the tokens the policy generated (a row's length must "
    "cover them); mismatch-probe compares the two sides' log-probs on those tokens only"
)


def check_step_has_model_tokens(
    samples: Iterable[DumpSample], *, hint: str = NO_MODEL_TOKENS_HINT
) -> Iterator[DumpSample]:
    """``samples``, passed through one at a time; once they are all read, a step in which none
    marks a generated token is an error naming its first row. Such a step imports as rows of
    prompt tokens, and ``analyze`` would then ask for a ``score`` that has nothing to compare
    either: the mask or the lengths the dump was written with are wrong."""
    first: str | None = None
    found, n = False, 0
    for sample in samples:
        if first is None:
            first = sample.where
        n += 1
        found = found or bool(np.any(np.asarray(sample.model_mask)))
        yield sample
    if first is not None and not found:
        raise ConfigError(
            f"{first} (the step's first row): none of the step's {n} samples has a generated token", hint=hint
        )


@dataclass
class Checked:
    """A validated sample: the rollout, and the trainer's log-probs (full length, NaN off model tokens)."""

    rollout: Rollout
    logp_trainer: np.ndarray | None


def to_rollout(
    sample: DumpSample,
    sample_id: int,
    *,
    vocab_size: int,
    num_experts: int | None = None,
) -> Checked:
    """Check one dumped sequence against the checkpoint and the per-token table's contract."""
    where = sample.where
    ids = np.asarray(sample.token_ids).reshape(-1)
    if ids.dtype.kind not in "iu":
        try:
            as_float = ids.astype(np.float64)
        except (TypeError, ValueError):
            as_float = np.full(len(ids), np.nan)
        if not np.all(np.isfinite(as_float) & (np.mod(as_float, 1) == 0)):
            raise ConfigError(f"{where}: token ids are not all integers")
        ids = as_float.astype(np.int64)
    n = len(ids)
    if n < 2:
        raise ConfigError(f"{where}: {n} token(s); a sample needs a prompt and a response")
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ConfigError(
            f"{where}: token id {bad} is outside the checkpoint's vocabulary (0..{vocab_size - 1})",
            hint="pass the checkpoint the run sampled from (--model); padding should have been stripped",
        )
    mask = np.asarray(sample.model_mask).reshape(-1).astype(bool)
    if len(mask) != n:
        raise ConfigError(f"{where}: the model-token mask has {len(mask)} entries for {n} tokens")
    if mask[0]:
        raise ConfigError(f"{where}: the first token is marked as sampled; it has no context to be sampled from")
    logp = _checked_logp(scatter_to_full(sample.logp_engine, mask, "engine log-probs", where), mask, where, "engine")
    trainer = None
    if sample.logp_trainer is not None:
        full = scatter_to_full(sample.logp_trainer, mask, "trainer log-probs", where)
        trainer = _checked_logp(full, mask, where, "trainer")
    if sample.turn is None:
        turn = infer_turns(mask)
    else:
        turn = np.asarray(sample.turn).reshape(-1).astype(np.int64)
        if len(turn) != n:
            raise ConfigError(f"{where}: {len(turn)} turn ids for {n} tokens")
        if np.any(turn[mask] < 0):
            raise ConfigError(
                f"{where}: a model token has turn {int(turn[mask].min())}; turns of model tokens are >= 0"
            )
        turn = np.where(mask, turn, -1).astype(np.int16)
    experts = None
    if sample.experts is not None:
        experts = _experts_of_model_tokens(np.asarray(sample.experts), mask, where, num_experts)
    rollout = Rollout(
        sample_id=sample_id,
        prompt_id=sample.prompt_id if sample.prompt_id is not None else prompt_key(ids, mask),
        token_ids=ids.astype(np.int32),
        turn=turn,
        is_model_token=mask,
        logp_infer=logp,
        finish_reason=sample.finish_reason or "unknown",
        experts_infer=experts,
        logp_trainer=trainer,
    )
    return Checked(rollout, trainer)


def _checked_logp(full: np.ndarray, mask: np.ndarray, where: str, side: str) -> np.ndarray:
    on = full[mask]
    if not sampled_logp_ok(on):
        bad = ~np.isfinite(on) | (on > LOGP_ROUNDING)  # where: the first one the rule refuses
        k = int(np.flatnonzero(bad)[0])
        position = int(np.flatnonzero(mask)[k])
        raise ConfigError(
            f"{where}: the {side} log-prob of the token at position {position} is {float(on[k])}; "
            "log-probs of sampled tokens are finite and <= 0"
        )
    out = np.full(len(full), np.nan, dtype=np.float32)
    out[mask] = np.minimum(on, 0.0)
    return out


def _experts_of_model_tokens(experts: np.ndarray, mask: np.ndarray, where: str, num_experts: int | None) -> np.ndarray:
    """int16 [model tokens, layers, k]: for the model token at t, the routing of input position t - 1."""
    n = len(mask)
    if experts.ndim != 3 or experts.shape[0] not in (n - 1, n):
        raise ConfigError(
            f"{where}: routed experts have shape {list(experts.shape)}; expected "
            f"[{n - 1} or {n} positions, MoE layers, top-k] for {n} tokens"
        )
    if experts.size and (experts.min() < 0 or (num_experts is not None and experts.max() >= num_experts)):
        raise ConfigError(
            f"{where}: routed expert ids span {int(experts.min())}..{int(experts.max())}; "
            f"the checkpoint has {num_experts} experts"
        )
    rows = np.flatnonzero(mask) - 1
    return np.sort(experts[rows], axis=-1).astype(np.int16)
