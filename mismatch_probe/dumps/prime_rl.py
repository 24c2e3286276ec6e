"""prime-rl's per-step files (PrimeIntellect-ai/prime-rl, read at 559b447, 2026-08-21), under the
run's ``output_dir``, which its orchestrator and trainer share:

- ``token_exports/step_{N}/rank_{r}.jsonl``, with ``trainer.enable_token_export = true``: written by
  ``TokenExporter.export`` (src/prime_rl/trainer/rl/token_export.py) after each micro-batch's
  forward, one line per packed sequence that has a loss-mask token, padding trimmed, through
  ``json.dumps(..., allow_nan=False)`` (a non-finite value is ``null``). Per line ``token_ids``,
  ``loss_mask``, ``inference_logprobs`` (the engine's, as the orchestrator sent them, in float32;
  0.0 off sampled tokens), ``trainer_logprobs`` (the trainer's forward of ``logits / temperature``
  on the step's weights, shifted so index t is token t: ``shift_tensor_right`` in
  src/prime_rl/trainer/rl/train.py), the loss's weight streams ``rl_weights`` / ``ce_weights`` /
  ``ref_kl_weights`` (each ``null`` per token when absent), and its address ``rank``,
  ``micro_step``, ``micro_sequence_idx``. ``STABLE`` is touched in the step's directory once every
  rank has flushed (``TokenExporter.mark_stable``): a step without it is still being written.
- ``rollouts/step_{N}/rank_{r}.bin``, with ``rollout_transport.type = "filesystem"`` (the default,
  zmq, writes nothing): the orchestrator's batch for data rank r (``FileSystemMicroBatchSender`` in
  src/prime_rl/transports/rollouts/filesystem.py, written to ``.tmp`` and renamed),
  ``msgspec.msgpack`` of ``list[MicroBatch]`` (src/prime_rl/transports/rollouts/types.py;
  ``array_like``, so fields by position, in their order since 2026-07-17). A micro-batch packs
  sequences (``sequence_lengths``; the last one holds the padding, env name "" and loss mask 0:
  ``pad_micro_batch`` in src/prime_rl/trainer/batch.py) with per token ``inference_logprobs``
  (verifiers' ``Branch.logprobs``: each sampled token's log-prob at its position, 0.0 elsewhere),
  ``temperatures`` (the environment's ``sampling_args["temperature"]``, stamped by
  ``TrainSink.process_group`` in src/prime_rl/orchestrator/train_sink.py) and ``routed_experts``
  (uint8 ``[tokens, layers, top-k]``, row t the routing of token t). Micro-batches that even out
  the ranks are copies with loss mask 0 (``_make_dummy_batch``), skipped as the export skips them.

A run that exports tokens has its steps in ``token_exports/`` (listed once ``STABLE``), read for
both sides; the rollouts, when the run also writes them, give the temperature and, matched line by
line through the address, the routing. A run without exports has its steps in ``rollouts/``: the
engine's side alone, which ``score`` compares with the reference. Tokens the loss trains only as
cross-entropy (``ce_weights`` alone: ``sft_distill``, a frozen model's tokens) are no sample of the
policy and are left out of the mask. vLLM's log-probs are its ``processed_logprobs`` (prime-rl's
inference config sets that mode: temperature, top-k, top-p); the trainer's are of
``logits / temperature``.

Step N trains policy v{N-1}; its rollouts were sampled by v{N-1} or up to
``max_off_policy_steps`` (default 8) versions before it. Import with the weights of v{N-1}, and read
an asynchronous run's engine-vs-trainer gap as the mismatch plus that staleness.

Nothing is unpickled: the rollouts decode into the structs below (msgspec checks every field's
type), the exports are JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from mismatch_probe.dumps import jsonl
from mismatch_probe.dumps.base import DumpReader, Listing, select_step
from mismatch_probe.dumps.samples import DumpSample
from mismatch_probe.errors import ConfigError

EXPORTS, ROLLOUTS, STABLE = "token_exports", "rollouts", "STABLE"
STEP_DIR = re.compile(r"^step_(\d+)$")
RANK_FILE = re.compile(r"^rank_(\d+)\.(jsonl|bin)$")
SCHEMA_VERSION = 1  # token_export.py's SCHEMA_VERSION
# the export's columns a sample needs; its diagnostics (entropy, ratios, masks) are skipped unparsed
EXPORT_ROW = jsonl.keeping(
    (
        "schema_version",
        "micro_step",
        "micro_sequence_idx",
        "token_ids",
        "loss_mask",
        "inference_logprobs",
        "trainer_logprobs",
        "rl_weights",
        "ce_weights",
        "ref_kl_weights",
    )
)
WHAT = "prime-rl token exports or rollouts (token_exports/step_<N>/, rollouts/step_<N>/)"
HOW_TO_DUMP = (
    "set trainer.enable_token_export = true (both sides' log-probs), or rollout_transport.type = "
    '"filesystem" (the engine\'s, with the temperature and routing)'
)
NO_TEMPERATURE = (
    "prime-rl's token export records no temperature and this run wrote no rollouts: the sampling temperature "
    "is --temperature's (the environment's sampling_args temperature)"
)


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False):
    data: bytes
    shape: list[int]  # [tokens, layers, top-k]
    dtype: str


class MicroBatch(msgspec.Struct, array_like=True, gc=False):
    """prime-rl's ``MicroBatch``, field for field in its order (array_like: by position)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: msgspec.Raw = msgspec.Raw()  # images' pixels: skipped, never decoded
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


class _Temperatures(msgspec.Struct, array_like=True, gc=False):
    """The fields a temperature needs; the others are skipped unparsed."""

    input_ids: msgspec.Raw
    loss_mask: list[bool]
    advantages: msgspec.Raw
    inference_logprobs: msgspec.Raw
    position_ids: msgspec.Raw
    sequence_lengths: msgspec.Raw
    temperatures: list[float]


class _Routed(msgspec.Struct, array_like=True, gc=False):
    """Whether a micro-batch holds routing; the fields before it are skipped unparsed."""

    input_ids: msgspec.Raw
    loss_mask: msgspec.Raw
    advantages: msgspec.Raw
    inference_logprobs: msgspec.Raw
    position_ids: msgspec.Raw
    sequence_lengths: msgspec.Raw
    temperatures: msgspec.Raw
    env_names: msgspec.Raw
    seq_lens: msgspec.Raw
    ref_logprobs: msgspec.Raw = msgspec.Raw()
    routed_experts: RoutedExperts | None = None


class PrimeRLDump(DumpReader):
    format = "prime-rl"

    def __init__(self, path: Path, *, step: int | None = None, listing: Listing | None = None, **_: Any) -> None:
        super().__init__(path, listing=listing)
        run, _only = _locate(path)
        steps = self.listed_steps(path)
        if not steps and not (run / EXPORTS).is_dir() and not (run / ROLLOUTS).is_dir():
            raise ConfigError(f"{path} holds no {WHAT}", hint=HOW_TO_DUMP)
        self.step, self.files = select_step(steps, step, path, WHAT, missing_hint=_unstable(run, step))
        self.exports = [f for f in self.files if f.suffix == ".jsonl"]
        self.batches = {_rank(f): f for f in self.files if f.suffix == ".bin"}
        self.has_trainer = bool(self.exports)
        if self.batches:
            self.settings["sampling.temperature"] = _temperature(list(self.batches.values()))
        else:
            self.notes.append(NO_TEMPERATURE)

    @classmethod
    def available_steps(cls, path: Path) -> dict[int, list[Path]]:
        """A run that exports tokens: each ``token_exports/step_N`` with ``STABLE``, its ranks' JSON
        Lines and, when written, ``rollouts/step_N``'s ranks; otherwise each ``rollouts/step_N``."""
        run, only = _locate(path)
        exports, rollouts = _step_dirs(run / EXPORTS), _step_dirs(run / ROLLOUTS)
        exporting = (run / EXPORTS).is_dir()
        steps: dict[int, list[Path]] = {}
        for n in sorted(exports if exporting else rollouts):
            if only is not None and n != only:
                continue
            files: list[Path] = []
            if exporting:
                if not (exports[n] / STABLE).is_file():
                    continue  # the trainer is still writing it (or stopped in it)
                files += _rank_files(exports[n], "jsonl")
            if n in rollouts:
                files += _rank_files(rollouts[n], "bin")
            if files:
                steps[n] = files
        return steps

    def read_samples(self) -> Iterator[DumpSample]:
        dropped = 0
        if self.exports:
            samples = self._exported()
        else:
            samples = (
                (f"step_{self.step}/{f.name}, micro-batch {i}, sequence {j}", seq)
                for _, f in sorted(self.batches.items())
                for (i, j), seq in _sequences(f, self.step)
            )
        for where, seq in samples:
            sample, ce_only = _sample(where, seq)
            dropped += ce_only
            yield sample
        if dropped:
            self.notes.append(
                f"{dropped} loss-mask tokens are trained as cross-entropy alone (a frozen model's tokens, not the "
                "policy's samples): left out of the comparison"
            )

    def _exported(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The export's lines, with the rollouts' routing where the run recorded it. The two line up
        rank by rank when the export's ranks are the rollouts' (no context parallelism)."""
        exports = sorted(self.exports, key=_rank)
        joined: bool | None = None if {_rank(f) for f in exports} == set(self.batches) else False
        for f in exports:
            routing = _routing(self.batches[_rank(f)], self.step) if joined is not False else {}
            if joined is None and not routing:
                joined = False  # the rollouts hold no routing
            for n, line in jsonl.lines(f):
                where = f"step_{self.step}/{f.name}:{n}"
                row = _export_row(jsonl.loads(line, where, EXPORT_ROW), where)
                seq = _exported_sequence(row, where, self.want_trainer)
                if joined is False:
                    yield where, seq
                    continue
                found = routing.get((row["micro_step"], row["micro_sequence_idx"]))
                same = found is not None and np.array_equal(found[0], seq["ids"])
                if joined is None:  # the step's first line decides, before any sample has routing
                    joined = same
                    if not same:
                        self.notes.append(
                            "the rollouts' routed experts do not line up with the token export (micro-batch and "
                            "sequence of the same rank hold other tokens); imported without routing"
                        )
                elif not same:
                    raise ConfigError(
                        f"{where}: rank {_rank(f)}'s rollouts hold other tokens at micro-batch {row['micro_step']}, "
                        f"sequence {row['micro_sequence_idx']}",
                        hint="the token export and the rollouts must be of one step of one run",
                    )
                if joined and found is not None:
                    seq["experts"] = found[1]
                yield where, seq


# ---- where the steps are ---------------------------------------------------------------------


def _locate(path: Path) -> tuple[Path, int | None]:
    """The run's output_dir, and the step a ``step_N`` directory given names."""
    if path.is_file():
        raise ConfigError(
            f"{path} is one rank's file of a step",
            hint="give its step directory (a step is every rank's file) or the run's output_dir",
        )
    match = STEP_DIR.match(path.name)
    if match and path.parent.name in (EXPORTS, ROLLOUTS):
        return path.parent.parent, int(match.group(1))
    if path.name in (EXPORTS, ROLLOUTS):
        return path.parent, None
    return path, None


def _step_dirs(directory: Path) -> dict[int, Path]:
    if not directory.is_dir():
        return {}
    found = {}
    for d in directory.iterdir():
        match = STEP_DIR.match(d.name)
        if match and d.is_dir():
            found[int(match.group(1))] = d
    return found


def _rank_files(directory: Path, suffix: str) -> list[Path]:
    """``rank_<r>.<suffix>`` by rank (not the ``.tmp`` a rank is written to before its rename)."""
    files = [f for f in directory.iterdir() if (m := RANK_FILE.match(f.name)) and m.group(2) == suffix]
    return sorted(files, key=_rank)


def _rank(f: Path) -> int:
    match = RANK_FILE.match(f.name)
    return int(match.group(1)) if match else -1


def _unstable(run: Path, step: int | None) -> str | None:
    """The hint for a step that is there but not listed: its export is still being written."""
    d = run / EXPORTS / f"step_{step}"
    if step is not None and d.is_dir() and not (d / STABLE).is_file():
        return f"{EXPORTS}/step_{step} has no {STABLE} yet: the trainer has not finished writing it"
    return None


# ---- the rollouts (msgpack) --------------------------------------------------------------------


def _decode(f: Path, kind: type) -> list:
    try:
        return msgspec.msgpack.decode(f.read_bytes(), type=list[kind])  # type: ignore[valid-type]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"{f} is not a list of prime-rl MicroBatch ({exc})",
            hint="mismatch-probe reads the rollouts of prime-rl since 2026-07-17 (seq_lens after env_names); "
            f"or give a run whose token exports hold the step ({HOW_TO_DUMP})",
        ) from None


def _temperature(files: list[Path]) -> float:
    """The step's sampling temperature: that of every loss-mask token, one for the step."""
    seen: set[float] = set()
    for f in files:
        for mb in _decode(f, _Temperatures):
            if len(mb.temperatures) != len(mb.loss_mask):
                raise ConfigError(f"{f}: {len(mb.temperatures)} temperatures for {len(mb.loss_mask)} tokens")
            t, mask = np.asarray(mb.temperatures), np.asarray(mb.loss_mask, dtype=bool)
            seen.update(np.unique(t[mask]).tolist())
    if len(seen) > 1:
        shown = ", ".join(f"{t:g}" for t in sorted(seen))
        raise ConfigError(
            f"{files[0].parent}: the step's samples were drawn at temperatures {shown} (environments of their own)",
            hint="mismatch-probe compares one sampling distribution per run: import a run whose environments "
            "share one temperature",
        )
    return float(next(iter(seen))) if seen else 1.0


def _sequences(f: Path, step: int | None) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
    """Each packed sequence with a loss-mask token, padding trimmed, by (micro-batch, sequence)."""
    for i, mb in enumerate(_decode(f, MicroBatch)):
        n = len(mb.input_ids)
        where = f"step_{step}/{f.name}, micro-batch {i}"
        for key in ("loss_mask", "inference_logprobs", "temperatures", "env_names"):
            if len(getattr(mb, key)) != n:
                raise ConfigError(f"{where}: {key} has {len(getattr(mb, key))} entries for {n} tokens")
        if sum(mb.sequence_lengths) != n:
            raise ConfigError(f"{where}: sequence_lengths sum to {sum(mb.sequence_lengths)} for {n} tokens")
        ids = jsonl.ints(mb.input_ids)
        mask = np.fromiter(mb.loss_mask, bool, n)
        logp = jsonl.floats(mb.inference_logprobs)
        ce_only = _ce_only(n, mb.rl_weights, mb.ce_weights, mb.ref_kl_weights)
        experts = _experts(mb.routed_experts, n, where)
        padding = np.fromiter((name == "" for name in mb.env_names), bool, n) & ~mask
        start = 0
        for j, length in enumerate(mb.sequence_lengths):
            end = start + length
            while end > start and padding[end - 1]:  # the micro-batch's padding: as the export trims it
                end -= 1
            if mask[start:end].any():
                yield (
                    (i, j),
                    {
                        "ids": ids[start:end],
                        "mask": mask[start:end],
                        "logp": logp[start:end],
                        "ce_only": ce_only[start:end] if ce_only is not None else None,
                        "experts": experts[start:end] if experts is not None else None,
                    },
                )
            start += length


def _experts(routed: RoutedExperts | None, n: int, where: str) -> np.ndarray | None:
    if routed is None:
        return None
    shape = tuple(routed.shape)
    try:
        rows = np.frombuffer(routed.data, dtype=np.dtype(routed.dtype)).reshape(shape)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: routed_experts ({routed.dtype}, shape {list(shape)}) cannot be read: {exc}"
        ) from None
    if rows.ndim != 3 or rows.shape[0] != n or rows.dtype.kind not in "iu":
        raise ConfigError(f"{where}: routed_experts of shape {list(shape)} ({routed.dtype}) for {n} tokens")
    return rows


def _routing(f: Path, step: int | None) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """{(micro-batch, sequence): (token ids, routed experts)} of one rank's rollouts; empty
    without routing (found by a pass that skips every other field)."""
    if all(mb.routed_experts is None for mb in _decode(f, _Routed)):
        return {}
    return {address: (seq["ids"], seq["experts"]) for address, seq in _sequences(f, step) if seq["experts"] is not None}


# ---- the token exports (JSON Lines) -----------------------------------------------------------


def _export_row(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: not a JSON object")
    if row.get("schema_version") != SCHEMA_VERSION:
        raise ConfigError(
            f"{where}: token export schema_version {row.get('schema_version')!r}; mismatch-probe reads "
            f"version {SCHEMA_VERSION}"
        )
    missing = [
        k
        for k in ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs", "micro_step")
        if row.get(k) is None
    ]
    if missing or "micro_sequence_idx" not in row:
        raise ConfigError(
            f"{where}: no {', '.join(missing or ['micro_sequence_idx'])}; not a prime-rl token export line"
        )
    return row


def _exported_sequence(row: dict, where: str, want_trainer: bool) -> dict[str, Any]:
    ids = jsonl.ints(row["token_ids"])
    n = len(ids)

    def per_token(key: str, *, mask: bool = False) -> np.ndarray:
        # null (a non-finite value): NaN, refused on a sampled token
        values = jsonl.flags(row[key]) if mask else jsonl.floats(row[key])
        if len(values) != n:
            raise ConfigError(f"{where}: {key} has {len(values)} entries for {n} token ids")
        return values

    return {
        "ids": ids,
        "mask": per_token("loss_mask", mask=True),
        "logp": per_token("inference_logprobs"),
        "trainer": per_token("trainer_logprobs") if want_trainer else None,
        "ce_only": _ce_only(n, row.get("rl_weights"), row.get("ce_weights"), row.get("ref_kl_weights")),
        "experts": None,
    }


# ---- both ------------------------------------------------------------------------------------


def _stream(values: Any, n: int) -> np.ndarray | None:
    """A loss-weight stream (None, or None per token: absent), zeros for null entries."""
    if values is None:
        return None
    w = jsonl.floats(values)
    if len(w) != n or np.isnan(w).all():
        return None
    return np.nan_to_num(w, nan=0.0)


def _ce_only(n: int, rl: Any, ce: Any, ref_kl: Any) -> np.ndarray | None:
    """The tokens the loss trains as cross-entropy alone (rl weight 0, no reverse-KL weight): a
    frozen model's tokens. An absent rl stream is weight 1.0 on every loss-mask token."""
    ce_w, rl_w, ref_w = _stream(ce, n), _stream(rl, n), _stream(ref_kl, n)
    if ce_w is None or rl_w is None:
        return None
    only = (ce_w != 0) & (rl_w == 0)
    if ref_w is not None:
        only &= ref_w == 0
    return only if only.any() else None


def _sample(where: str, seq: dict[str, Any]) -> tuple[DumpSample, int]:
    """The sample, and how many of its loss-mask tokens were left out as cross-entropy alone."""
    mask, ce_only = seq["mask"], seq["ce_only"]
    dropped = 0
    if ce_only is not None:
        dropped = int(np.count_nonzero(mask & ce_only))
        mask = mask & ~ce_only
    sample = DumpSample(
        where=where,
        token_ids=seq["ids"],
        model_mask=mask,
        logp_engine=seq["logp"],
        logp_trainer=seq.get("trainer"),
        experts=seq["experts"],
    )
    return sample, dropped
