"""An RL framework's prompt dataset sampled into a probe prompts file (``mismatch-probe init``).

A framework trains on a dataset of prompts in its own layout; the probe's prompts file
(:mod:`mismatch_probe.rollout.prompts`) is JSON Lines of ``"messages"`` or ``"prompt"``. This
module reads the user's files (Parquet, JSON Lines, a JSON array; a directory or a list of them,
as verl's ``data.train_files``), turns each row's prompt into what the framework would render
(:class:`DatasetLayout`), and writes a seeded sample stratified by prompt length, so that the
probe sees the short and the long prompts the run trains on, not only the typical ones.

Two streaming passes, so a multi-GB dataset is never held whole: the first reads only the prompt
column (Parquet ``columns=``, batch by batch; JSON Lines decoding only the prompt's member) and
keeps one length per row; the second reads only the sampled rows again (Parquet: the row groups
that hold them, then those rows alone). ``benchmarks/bench_dataset_prompts.py`` measures both.

A row whose prompt is missing, empty or not of the layout's shape is skipped and counted (the
first one is reported), never an error, unless no row is usable: then a :class:`ConfigError`
names the file and what to pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import atomic_path, portable_path

Shape = Literal["messages", "text", "text-as-chat", "auto"]
SHAPES: tuple[str, ...] = ("messages", "text", "text-as-chat", "auto")
SUFFIXES = (".parquet", ".jsonl", ".json")
BATCH_ROWS = 8192
# the fixes the errors name; worded without a flag until `init` has its --prompt-key option
# (tests/unit/test_settings.py refuses a message naming a flag no command has)
PROMPT_KEY_HINT = "pass --prompt-key"


@dataclass(frozen=True)
class DatasetLayout:
    """Where a dataset row holds its prompt and how the framework renders it.

    ``shape``:

    * ``"messages"``: a chat, a list of ``{"role", "content"}`` (verl's and SkyRL's Parquet
      ``prompt`` column, TRL's conversational ``prompt``, ms-swift's ``messages``);
    * ``"text"``: a raw string tokenized as it is, no chat template (OpenRLHF and slime without
      ``--apply-chat-template``);
    * ``"text-as-chat"``: a raw string the framework wraps as one user message and renders with
      the chat template (OpenRLHF and slime with ``--apply-chat-template``, NeMo-RL's response
      datasets); a row that already holds a chat is taken as it is, as OpenRLHF and slime do;
    * ``"auto"``: a list is a chat and a string raw text, row by row (TRL's ``is_conversational``).

    ``input_template`` (a ``str.format`` string with one ``{}``) wraps raw text before anything
    else (OpenRLHF's ``--input_template``, NeMo-RL's ``prompt_file``); ``system_key`` (a column)
    or else ``system_prompt`` is prepended as a system message to a chat that has none
    (verifiers' ``system_prompt``, ms-swift's ``system`` column, NeMo-RL's ``system_prompt_file``);
    ``drop_response`` removes a chat's trailing assistant message, the reference answer
    (ms-swift's ``remove_response``).
    """

    prompt_key: str = "prompt"
    shape: Shape = "messages"
    system_key: str | None = None
    system_prompt: str | None = None
    input_template: str | None = None
    drop_response: bool = False

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ConfigError(f"unknown prompt layout {self.shape!r}", hint=f"use one of {', '.join(SHAPES)}")
        if not self.prompt_key:
            raise ConfigError("the prompt key is empty", hint=PROMPT_KEY_HINT)
        if self.input_template is not None and "{}" not in self.input_template:
            raise ConfigError(f"the input template {self.input_template!r} has no '{{}}' for the prompt")
        if self.shape == "text" and (self.system_key or self.system_prompt):
            raise ConfigError(
                "a system prompt needs a chat template, but the layout is raw text",
                hint="use the 'text-as-chat' layout, as the framework does when it applies the chat template",
            )

    def with_changes(self, **changes: Any) -> DatasetLayout:
        """The layout with some fields replaced (a framework's config overriding its defaults)."""
        return replace(self, **changes)

    def keys(self) -> list[str]:
        return [self.prompt_key] + ([self.system_key] if self.system_key else [])


# Each framework's default: what its trainer reads when its config names no other key. Read at the
# commits below (the newest stored snapshot of each repository on 2026-08-22).
LAYOUTS: dict[str, DatasetLayout] = {
    # volcengine/verl@b178a3cd verl/utils/dataset/rl_dataset.py:106 (prompt_key default "prompt"),
    # :297 (messages = example[self.prompt_key]: a chat list; its parquet column a list<struct<content, role>>)
    "verl": DatasetLayout("prompt", "messages"),
    # NovaSky-AI/SkyRL@a9564572 skyrl/train/dataset/dataset.py:23 (prompt_key "prompt"),
    # :10 and :88 (the chat list rendered with apply_chat_template(add_generation_prompt=True))
    "skyrl": DatasetLayout("prompt", "messages"),
    # OpenRLHF/OpenRLHF@3c3be623 openrlhf/cli/train_ppo_ray.py:542 (--data.input_key default "input"),
    # :546 (--data.apply_chat_template off by default); openrlhf/datasets/prompts_dataset.py:26-41
    # (preprocess_data: a string wrapped as one user message when the template applies; otherwise the
    # raw string, through --data.input_template "{}")
    "openrlhf": DatasetLayout("input", "text"),
    # THUDM/slime@624b824a slime/utils/arguments.py:656 (--apply-chat-template off), :659 (--input-key
    # default "input"); slime/utils/data.py:142-150 (_build_messages: a string kept as it is, or
    # wrapped as one user message when the template applies; a list is a chat)
    "slime": DatasetLayout("input", "text"),
    # huggingface/trl@f2cd5771 trl/trainer/grpo_trainer.py:2274 (prompts = [x["prompt"] ...]);
    # trl/data_utils.py:160 (is_conversational: a list of messages is conversational, a string standard)
    "trl": DatasetLayout("prompt", "auto"),
    # modelscope/ms-swift@3602360a swift/dataset/preprocessor/core.py:378-407 (query/system/response
    # columns become "messages", the system first), swift/rlhf_trainers/grpo_trainer.py:855
    # (remove_response: the trailing assistant message is the answer, not the prompt)
    "ms-swift": DatasetLayout("messages", "messages", drop_response=True),
    # NVIDIA-NeMo/RL@7ea279ab nemo_rl/data/datasets/response_datasets/response_dataset.py:45 (input_key
    # default "input"), :81 (wrapped as {"role": "user"}); nemo_rl/data/processors.py:396-413
    # (math_hf_data_processor: system_prompt first, the prompt_file's template around the problem,
    # rendered with the chat template)
    "nemo-rl": DatasetLayout("input", "text-as-chat"),
    # PrimeIntellect-ai/prime-rl@559b4477 trains on verifiers environments:
    # PrimeIntellect-ai/verifiers@a60a606e verifiers/legacy/envs/environment.py:278-341 (_ensure_prompt:
    # a "prompt" chat list, the system_prompt prepended unless the chat starts with a system message;
    # a dataset without "prompt" has its question_key "question" wrapped as one user message)
    "prime-rl": DatasetLayout("prompt", "messages"),
}


@dataclass(frozen=True)
class Stratum:
    """One length stratum: the lengths it spans, its rows and how many were taken."""

    lo: int
    hi: int
    rows: int
    taken: int


@dataclass(frozen=True)
class DatasetPrompts:
    """What :func:`write_dataset_prompts` wrote, for the caller to print and record."""

    out: Path
    written: int
    rows: int  # every row read, usable or not
    skipped: int
    first_skipped: str | None  # "file row k: why"
    strata: tuple[Stratum, ...]
    length_unit: Literal["tokens", "characters"]
    sources: tuple[str, ...]
    layout: DatasetLayout
    seed: int

    @property
    def strata_edges(self) -> list[int]:
        """The length at which each stratum after the first begins."""
        return [s.lo for s in self.strata[1:]]

    def summary(self) -> str:
        files = self.sources[0] if len(self.sources) == 1 else f"{len(self.sources)} files"
        text = f"wrote {self.written} of {self.rows - self.skipped} prompts from {files} to {self.out}"
        if len(self.strata) > 1:
            spans = ", ".join(f"{s.lo}-{s.hi}: {s.taken}" for s in self.strata)
            text += f"; by {self.length_unit} ({spans})"
        if self.skipped:
            text += f"; skipped {self.skipped} rows (first: {self.first_skipped})"
        return text

    def record(self) -> dict[str, Any]:
        return {
            "out": portable_path(self.out),
            "written": self.written,
            "rows": self.rows,
            "skipped": self.skipped,
            "first_skipped": self.first_skipped,
            "strata": [asdict(s) for s in self.strata],
            "strata_edges": self.strata_edges,
            "length_unit": self.length_unit,
            "sources": list(self.sources),
            "layout": asdict(self.layout),
            "seed": self.seed,
        }


# -- files


def dataset_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """The data files of ``paths``: files as given, a directory's ``.parquet``, ``.jsonl`` and
    ``.json`` files (recursively, sorted, hidden ones skipped)."""
    given = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not given:
        raise ConfigError("no dataset given", hint="name the dataset's files or directory")
    out: list[Path] = []
    for raw in given:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix in SUFFIXES
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise ConfigError(f"no {', '.join(SUFFIXES)} files in the directory {p}")
            out.extend(found)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ConfigError(
                    f"dataset file {p} is not {', '.join(SUFFIXES)}", hint="convert it to Parquet or JSON Lines"
                )
            out.append(p)
        else:
            raise ConfigError(f"dataset {str(p)!r} does not exist")
    return out


def _labels(files: list[Path]) -> list[str]:
    """Each file's id prefix: its stem, or ``stem.k`` (its position) where two files share a stem."""
    stems = [f.stem for f in files]
    return [s if stems.count(s) == 1 else f"{s}.{k}" for k, s in enumerate(stems)]


class _MissingKey(Exception):
    def __init__(self, columns: list[str]):
        self.columns = columns


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(b"[")


def _batches(path: Path, keys: list[str], rows: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, list[tuple]]]:
    """``(row indices, [(value of each key), ...])`` per batch of ``path``, only ``keys`` read; only
    the rows ``rows`` (sorted) when given. A row's index: its position in the file (a JSON Lines
    row is a non-blank line). A key other than the first (the prompt) may be absent: ``None``."""
    if path.suffix == ".parquet":
        yield from _parquet_batches(path, keys, rows)
    elif path.suffix == ".jsonl" or not _is_json_array(path):  # HF's json loader reads .json lines too
        yield from _jsonl_batches(path, keys, rows)
    else:
        yield from _json_array_batches(path, keys, rows)


def _parquet_batches(path: Path, keys: list[str], rows: np.ndarray | None) -> Iterator[tuple[np.ndarray, list[tuple]]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's message says what is wrong with the file
        raise ConfigError(f"cannot read {path} as Parquet: {exc}") from None
    names = pf.schema_arrow.names
    if keys[0] not in names:
        raise _MissingKey(names)
    present = [k for k in keys if k in names]

    def values(table) -> list[tuple]:
        cols = [table.column(k).to_pylist() if k in present else [None] * table.num_rows for k in keys]
        return list(zip(*cols))

    if rows is None:
        start = 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=present):
            yield np.arange(start, start + batch.num_rows), values(batch)
            start += batch.num_rows
        return
    bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
    for g in range(pf.num_row_groups):
        lo, hi = np.searchsorted(rows, [bounds[g], bounds[g + 1]])
        if lo == hi:
            continue
        wanted = rows[lo:hi]
        table = pf.read_row_group(g, columns=present).take(wanted - bounds[g])
        yield wanted, values(table)


def _jsonl_batches(path: Path, keys: list[str], rows: np.ndarray | None) -> Iterator[tuple[np.ndarray, list[tuple]]]:
    import msgspec

    decode = msgspec.json.Decoder().decode
    wanted = None if rows is None else set(rows.tolist())
    index: list[int] = []
    batch: list[tuple] = []
    row = -1
    with open(path, "rb", buffering=1 << 20) as fh:
        for line in fh:
            if not line.strip():
                continue
            row += 1
            if wanted is not None and row not in wanted:
                continue
            try:
                obj = decode(line)
            except msgspec.DecodeError:
                try:
                    obj = json.loads(line)  # NaN and Infinity, which msgspec refuses
                except (json.JSONDecodeError, UnicodeDecodeError):
                    obj = _NOT_JSON
            index.append(row)
            batch.append(_pick(obj, keys))
            if len(batch) >= BATCH_ROWS:
                yield np.asarray(index), batch
                index, batch = [], []
    if batch:
        yield np.asarray(index), batch


def _json_array_batches(
    path: Path, keys: list[str], rows: np.ndarray | None
) -> Iterator[tuple[np.ndarray, list[tuple]]]:
    try:
        with open(path, "rb") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not JSON ({getattr(exc, 'msg', exc)})") from None
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a JSON array of rows, got {type(data).__name__}")
    index = np.arange(len(data)) if rows is None else rows
    for lo in range(0, len(index), BATCH_ROWS):
        part = index[lo : lo + BATCH_ROWS]
        yield part, [_pick(data[k], keys) for k in part.tolist()]


class _BadRow:
    """A JSON row that has no prompt to look for: why."""

    def __init__(self, why: str):
        self.why = why


_NOT_JSON = _BadRow("not JSON")
_NOT_OBJECT = _BadRow("not a JSON object")
_ABSENT = _BadRow("")  # the key is missing: the message names it


def _pick(obj: object, keys: list[str]) -> tuple:
    if isinstance(obj, _BadRow):
        return (obj, *(None for _ in keys[1:]))
    if isinstance(obj, dict):
        return (obj.get(keys[0], _ABSENT), *(obj.get(k) for k in keys[1:]))
    return (_NOT_OBJECT, *(None for _ in keys[1:]))


# -- one row's prompt


class _Unusable(Exception):
    pass


def _what(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def prompt_of(value: object, system: object, layout: DatasetLayout) -> tuple[str, Any]:
    """A row's prompt as a prompts-file line's kind and value (``("messages", chat)`` or
    ``("prompt", text)``), as the framework renders it; :class:`ValueError` says why a row has none."""
    try:
        return _prompt_of(value, system, layout)
    except _Unusable as exc:
        raise ValueError(str(exc)) from None


def _prompt_of(value: object, system: object, layout: DatasetLayout) -> tuple[str, Any]:
    if value is _ABSENT:
        raise _Unusable(f"no {layout.prompt_key!r}")
    if isinstance(value, _BadRow):
        raise _Unusable(value.why)
    if isinstance(value, np.ndarray):  # pandas' and datasets' numpy arrays of message dicts
        value = value.tolist()
    shape = layout.shape
    if shape == "auto" or (shape == "text-as-chat" and isinstance(value, list)):
        shape = "messages" if isinstance(value, list) else ("text-as-chat" if shape == "text-as-chat" else "text")
    if shape in ("text", "text-as-chat"):
        if not isinstance(value, str):
            raise _Unusable(f"{layout.prompt_key!r} is {_what(value)}, not a string")
        if not value.strip():
            raise _Unusable(f"{layout.prompt_key!r} is empty")
        text = layout.input_template.replace("{}", value, 1) if layout.input_template else value
        if shape == "text":
            return "prompt", text
        messages = [{"role": "user", "content": text}]
    else:
        if not isinstance(value, list) or not value:
            raise _Unusable(f"{layout.prompt_key!r} is {_what(value) if value != [] else 'an empty list'}, not a chat")
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                content = m.get("content") if isinstance(m, dict) else None
                why = " (multimodal content is not supported)" if isinstance(content, (list, np.ndarray)) else ""
                raise _Unusable(f"message {i} needs string 'role' and 'content'{why}")
            messages.append({"role": m["role"], "content": m["content"]})
        if layout.drop_response and len(messages) > 1 and messages[-1]["role"] == "assistant":
            messages.pop()
        if messages[0]["role"] == "assistant":
            raise _Unusable("the chat starts with an assistant message")
        if not any(m["content"].strip() for m in _before_assistant(messages)):
            raise _Unusable("every prompt message is empty")
    sys = system if isinstance(system, str) and system.strip() else layout.system_prompt
    if sys and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": sys})
    return "messages", messages


def _before_assistant(messages: list[dict]) -> list[dict]:
    """The messages the probe renders as the prompt (the rest it replays: rollout/prompts.py)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:first]


# -- lengths


class _Lengths:
    """Prompt lengths, in characters or in the tokens the probe will feed the engine."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.unit: Literal["tokens", "characters"] = "characters" if tokenizer is None else "tokens"

    def of(self, prompts: list[tuple[str, Any]]) -> list[int | str]:
        """One length per prompt, or a string saying why it has none (a chat template's error)."""
        if self.tokenizer is None:
            return [
                len(value) if kind == "prompt" else sum(len(m["content"]) for m in _before_assistant(value))
                for kind, value in prompts
            ]
        out: list[int | str] = [0] * len(prompts)
        chats: list[tuple[int, str]] = []
        texts: list[tuple[int, str]] = []
        for i, (kind, value) in enumerate(prompts):
            if kind == "prompt":
                texts.append((i, value))
                continue
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(
                    "the dataset's prompts are chat messages but the tokenizer has no chat template",
                    hint="pass a chat model's checkpoint, or a raw text layout",
                )
            try:
                rendered = self.tokenizer.apply_chat_template(
                    _before_assistant(value), tokenize=False, add_generation_prompt=True
                )
                chats.append((i, rendered))
            except Exception as exc:  # the user's data meeting the model's template
                out[i] = f"the chat template failed ({exc})"
        # as rollout/prompts.py tokenizes: raw text with the tokenizer's special tokens, a rendered chat without
        for group, special in ((texts, True), (chats, False)):
            if group:
                ids = self.tokenizer([t for _, t in group], add_special_tokens=special)["input_ids"]
                for (i, _), row in zip(group, ids):
                    out[i] = len(row)
        return out


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, (str, Path)):
        from mismatch_probe.modeling.loading import load_tokenizer

        return load_tokenizer(Path(tokenizer))
    return tokenizer


# -- sampling


def stratified_sample(lengths: np.ndarray, n: int, strata: int, seed: int) -> tuple[np.ndarray, tuple[Stratum, ...]]:
    """Positions of ``n`` of ``lengths``, an equal share (within one) from each of ``strata`` length
    strata, and the strata. A stratum is a run of the rows sorted by length (ties in row order),
    the rows split as evenly as they go: quantile strata whose sizes differ by one at most, so a
    length may span two. Deterministic given ``seed``; ``n >= len(lengths)`` takes every row."""
    lengths = np.asarray(lengths, dtype=np.int64)
    m = len(lengths)
    if m == 0:
        return np.zeros(0, dtype=np.int64), ()
    order = np.argsort(lengths, kind="stable")
    chunks = np.array_split(order, max(1, min(strata, m)))
    sizes = np.array([len(c) for c in chunks])
    rng = np.random.default_rng(seed)
    if n >= m:
        quota = sizes.copy()
    else:
        quota = np.minimum(np.full(len(chunks), max(n, 0) // len(chunks)), sizes)
        while (left := n - int(quota.sum())) > 0:  # the remainder, to strata drawn at random
            room = np.flatnonzero(sizes > quota)
            quota[rng.permutation(room)[:left]] += 1
    taken = [rng.choice(c, size=int(q), replace=False) for c, q in zip(chunks, quota)]
    picked = np.sort(np.concatenate(taken)) if taken else np.zeros(0, dtype=np.int64)
    info = tuple(Stratum(int(lengths[c[0]]), int(lengths[c[-1]]), len(c), int(q)) for c, q in zip(chunks, quota))
    return picked, info


# -- the whole


@dataclass
class _Scan:
    source: list[int] = field(default_factory=list)
    row: list[np.ndarray] = field(default_factory=list)
    length: list[np.ndarray] = field(default_factory=list)
    rows: int = 0
    skipped: int = 0
    first_skipped: str | None = None


def _missing(path: Path, key: str, columns: list[str]) -> ConfigError:
    cols = ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "")
    return ConfigError(f"column {key!r} not found in {path.name} (columns: {cols})", hint=PROMPT_KEY_HINT)


def write_dataset_prompts(
    paths: str | Path | Sequence[str | Path],
    out: str | Path,
    *,
    layout: DatasetLayout,
    n: int,
    seed: int = 0,
    strata: int = 4,
    tokenizer: Any = None,
) -> DatasetPrompts:
    """Sample ``n`` prompts of the dataset at ``paths`` into the probe prompts file ``out``.

    ``layout`` says where each row's prompt is and how the framework renders it (:data:`LAYOUTS`
    has each framework's default). The sample is stratified by length (:func:`stratified_sample`):
    tokens when ``tokenizer`` is given (a checkpoint directory, or a loaded tokenizer), counted as
    the probe will tokenize the prompt, else characters. Each prompt keeps its row as its id,
    ``<file stem>-<row>`` (row from 0). The file is written atomically and read back with the
    probe's own parser before it replaces ``out``.
    """
    if n < 1:
        raise ConfigError(f"the number of prompts must be at least 1, got {n}")
    if strata < 1:
        raise ConfigError(f"the number of length strata must be at least 1, got {strata}")
    files = dataset_files(paths)
    labels = _labels(files)
    lengths = _Lengths(_load_tokenizer(tokenizer))
    keys = layout.keys()
    scan = _Scan()
    for k, path in enumerate(files):
        seen_key = False
        try:
            for rows, values in _batches(path, keys):
                prompts: list[tuple[str, Any]] = []
                good: list[int] = []
                for j, (value, *rest) in enumerate(values):
                    seen_key = seen_key or not isinstance(value, _BadRow)
                    try:
                        prompts.append(_prompt_of(value, rest[0] if rest else None, layout))
                        good.append(j)
                    except _Unusable as exc:
                        _skip(scan, labels[k], int(rows[j]), str(exc))
                measured = lengths.of(prompts)
                keep_rows, keep_lengths = [], []
                for j, got in zip(good, measured):
                    if isinstance(got, str):
                        _skip(scan, labels[k], int(rows[j]), got)
                    else:
                        keep_rows.append(int(rows[j]))
                        keep_lengths.append(got)
                scan.rows += len(values)
                if keep_rows:
                    scan.source.append(k)
                    scan.row.append(np.asarray(keep_rows, dtype=np.int64))
                    scan.length.append(np.asarray(keep_lengths, dtype=np.int64))
        except _MissingKey as exc:
            raise _missing(path, layout.prompt_key, exc.columns) from None
        if not seen_key and path.suffix != ".parquet":
            raise _missing(path, layout.prompt_key, sorted(_json_keys(path)))
    usable = scan.rows - scan.skipped
    if usable == 0:
        where = files[0].name if len(files) == 1 else f"{len(files)} files"
        raise ConfigError(
            f"no usable prompt in {where}: {scan.first_skipped or 'no rows'}",
            hint="check the prompt key and the prompt layout (messages, text, text-as-chat)",
        )
    src = np.concatenate([np.full(len(r), s, dtype=np.int32) for s, r in zip(scan.source, scan.row)])
    row = np.concatenate(scan.row)
    picked, info = stratified_sample(np.concatenate(scan.length), n, strata, seed)
    written = _write(out, files, labels, keys, layout, src[picked], row[picked])
    return DatasetPrompts(
        out=Path(out),
        written=written,
        rows=scan.rows,
        skipped=scan.skipped,
        first_skipped=scan.first_skipped,
        strata=info,
        length_unit=lengths.unit,
        sources=tuple(portable_path(f) for f in files),
        layout=layout,
        seed=seed,
    )


def _skip(scan: _Scan, label: str, row: int, why: str) -> None:
    scan.skipped += 1
    if scan.first_skipped is None:
        scan.first_skipped = f"{label} row {row}: {why}"


def _json_keys(path: Path, limit: int = 100) -> set[str]:
    """The keys of the first ``limit`` rows, for the missing-key message."""
    found: set[str] = set()
    try:
        if _is_json_array(path) and path.suffix != ".jsonl":
            with open(path, "rb") as fh:
                data = json.load(fh)
            for obj in data[:limit]:
                found.update(obj if isinstance(obj, dict) else ())
        else:
            with open(path, "rb") as fh:
                for k, line in enumerate(fh):
                    if k >= limit:
                        break
                    try:
                        obj = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        continue
                    found.update(obj if isinstance(obj, dict) else ())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        pass
    return found


def _write(
    out: str | Path,
    files: list[Path],
    labels: list[str],
    keys: list[str],
    layout: DatasetLayout,
    src: np.ndarray,
    row: np.ndarray,
) -> int:
    from mismatch_probe.rollout.prompts import read_prompt_records

    lines: list[str] = []
    for k, path in enumerate(files):
        rows = np.sort(row[src == k])
        if not len(rows):
            continue
        for got, values in _batches(path, keys, rows):
            for r, (value, *rest) in zip(got.tolist(), values):
                kind, prompt = _prompt_of(value, rest[0] if rest else None, layout)
                lines.append(json.dumps({"id": f"{labels[k]}-{r}", kind: prompt}, ensure_ascii=False))
    with atomic_path(out) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        read_prompt_records(tmp)  # the probe's own parser: a file it would refuse is never left behind
    return len(lines)
