"""Reading SGLang's answers: finish reasons, and the sampled and prefill log-probs from its
``(logprob, token_id, text)`` entries, with the workaround for the prompt log-prob SGLang reports at
the vocabulary's last id. Shared by the in-process adapter and the remote engine's ``sglang`` dialect."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def finish_reason(meta: dict, what: str) -> str:
    """ "stop" or "length" from SGLang's ``meta_info``. An aborted request (prompt over the context
    length, KV cache too small for it, ...) is not a sample to score: its tokens stop wherever the
    abort hit, so it raises with SGLang's own message instead of passing for a normal stop."""
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind == "abort":
        raise RuntimeError(
            f"SGLang aborted {what}: {finish.get('message') or 'no message'} (status "
            f"{finish.get('status_code')}); if it names the KV cache or the context length, raise "
            "--max-total-tokens / --max-model-len or lower --max-tokens"
        )
    return "length" if kind in (None, "length") else "stop"


# SGLang (0.5.23 and earlier) reports the id of every prompt token equal to the vocabulary's last
# id, V - 1, as 0 in ``input_token_logprobs``: logprob_result_processor.py clips the ids it returns
# with ``x if x < vocab_size - 1 else 0`` (meant for multimodal hash pads, >= V), while the log-prob
# beside it is gathered at the real id (schedule_batch.py clamps to V - 1 inclusive). Only that
# pair, on the prefill path alone, is taken as the token it is; every other position stays checked.
LAST_ID_FINDING = "docs/engine-findings/sglang-last-vocab-id-reported-as-0.md"
LAST_ID_WORKAROUND = (
    "a prompt log-prob entry SGLang reports for token 0 where the token is the vocabulary's last id "
    "(V - 1) is taken as that token's: SGLang rewrites the returned id (x < vocab_size - 1 else 0), "
    f"not the log-prob ({LAST_ID_FINDING})"
)


def text_vocab_size(model_path: Path) -> int | None:
    """The vocabulary size SGLang's ModelConfig reads (the text config's ``vocab_size``), from the
    checkpoint's config.json; None when it has none."""
    import json

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("vocab_size", config.get("vocab_size"))
    return int(size) if isinstance(size, int) else None


def last_id_workaround(last_id: int | None, restored: int) -> dict:
    """run.json's ``engine.workarounds`` entry for :data:`LAST_ID_WORKAROUND`: what it does and how
    many prompt log-prob entries it has restored so far (0: it never applied)."""
    if last_id is None:
        return {}
    return {"last_vocab_id_reported_as_0": {"what": LAST_ID_WORKAROUND, "token_id": last_id, "restored": restored}}


class PrefillLogprobs:
    """Reads SGLang's prefill log-probs of a checkpoint, for the in-process adapter and the remote
    engine's ``sglang`` dialect alike: :data:`LAST_ID_WORKAROUND` applied and counted, every other
    id checked (:func:`sampled_logprobs`)."""

    def __init__(self, model_path: Path) -> None:
        vocab_size = text_vocab_size(model_path)
        self.last_id = None if vocab_size is None else vocab_size - 1
        self.restored = 0

    def read(self, entries, token_ids: np.ndarray) -> np.ndarray:
        """The log-prob of each of ``token_ids`` from the entries that score them (SGLang's
        ``input_token_logprobs`` less its first, which has none)."""
        entries, restored = restore_last_id(entries, token_ids, self.last_id)
        self.restored += restored
        return sampled_logprobs(entries, token_ids)

    def workarounds(self) -> dict:
        return last_id_workaround(self.last_id, self.restored)


def restore_last_id(entries, token_ids: np.ndarray, last_id: int | None) -> tuple[list | None, int]:
    """Prefill entries with the id SGLang rewrote to 0 at the vocabulary's last id put back (see
    :data:`LAST_ID_WORKAROUND`), and how many were; anything else is left for
    :func:`sampled_logprobs` to check."""
    if not entries or last_id is None or len(entries) != len(token_ids):
        return entries, 0
    at = [k for k, (e, t) in enumerate(zip(entries, token_ids)) if int(t) == last_id and e[1] == 0]
    if not at:
        return entries, 0
    fixed = list(entries)
    for k in at:
        fixed[k] = (fixed[k][0], last_id, *fixed[k][2:])
    return fixed, len(at)


def sampled_logprobs(entries, token_ids: np.ndarray) -> np.ndarray:
    """The log-prob of each of ``token_ids`` from SGLang's ``(logprob, token_id, text)`` triples,
    one per position; a missing entry or one for another token is an engine bug and raises."""
    n = len(token_ids)
    if n == 0:
        return np.zeros(0, np.float32)
    if entries is None or len(entries) != n:
        got = "none" if entries is None else len(entries)
        raise RuntimeError(f"SGLang returned {got} log-prob entries for {n} tokens (return_logprob was requested)")
    values = np.array([e[0] if e[0] is not None else np.nan for e in entries], dtype=np.float64)
    ids = np.array([e[1] for e in entries], dtype=np.int64)
    wrong = np.flatnonzero(ids != np.asarray(token_ids, dtype=np.int64))
    if wrong.size:
        k = int(wrong[0])
        raise RuntimeError(
            f"SGLang's log-prob entry {k} is for token {int(ids[k])}, but the token there is {int(token_ids[k])}"
        )
    if np.isnan(values).any():
        k = int(np.flatnonzero(np.isnan(values))[0])
        raise RuntimeError(f"SGLang returned no log-prob for token {int(token_ids[k])} at position {k}")
    return values.astype(np.float32)
