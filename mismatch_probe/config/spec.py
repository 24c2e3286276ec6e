"""Probe specification: what to load, how to sample, how to score (DESIGN §5).

A spec comes from a TOML file (``probes/*.toml``) and/or CLI flags; flags win. Paths inside a
spec file are relative to that file, so a spec works from any working directory. Every field is
validated here, once, with a message that names the field and the accepted values.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
import re
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import read_text

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# auto: sdpa where the architecture supports it, else eager (hf_models.choose_attention)
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DEVICES = ("auto", "cpu", "cuda")
# attention that runs per packed sequence from cu_seq_lens, without a [T x T] mask
SP_ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")


# What an engine's log-probs are taken from: the raw logits, or after temperature/top-k/top-p.
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class CorrectionThresholds:
    """Thresholds of the correction what-ifs; defaults follow verl's rollout correction.

    verl: ``rollout_is_threshold`` 2.0, RS lower bound the reciprocal of the upper one, geometric
    RS thresholds "typically 1.0002 - 1.001", token veto "typically 1e-4 to 1e-6".
    """

    token_tis: float = 2.0
    token_mask_low: float = 0.5
    token_mask_high: float = 2.0
    seq_tis: float = 2.0
    seq_mis: float = 2.0
    geo_eps: float = 1e-3
    worst_token_tau: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("token_tis", "token_mask_high", "seq_tis", "seq_mis"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"correction threshold {name} must be > 1, got {getattr(self, name)}")
        if not 0.0 < self.token_mask_low < 1.0:
            raise ValueError(f"token_mask_low must be in (0, 1), got {self.token_mask_low}")
        if not 0.0 < self.geo_eps < 1.0:
            raise ValueError(f"geo_eps must be in (0, 1), got {self.geo_eps}")
        if not 0.0 < self.worst_token_tau < 1.0:
            raise ValueError(f"worst_token_tau must be in (0, 1), got {self.worst_token_tau}")

    def as_record(self) -> dict:
        """The thresholds as they appear in run.json, next to the share each one produces."""
        return {
            "token_tis_clipped_share": {"ratio_above": self.token_tis},
            "token_mask_share": {"ratio_below": self.token_mask_low, "ratio_above": self.token_mask_high},
            "seq_tis_clipped_share": {"seq_ratio_above": self.seq_tis},
            "seq_mis_masked_share": {"seq_ratio_above": self.seq_mis},
            "geo_rejected_share": {"geo_ratio_below": 1.0 - self.geo_eps, "geo_ratio_above": 1.0 + self.geo_eps},
            "worst_token_rejected_share": {"min_token_ratio_below": self.worst_token_tau},
        }


def normalize_dtype(value: str, *, field_name: str, allow_auto: bool) -> str:
    v = str(value).strip().lower()
    if allow_auto and v == "auto":
        return "auto"
    if v in DTYPE_ALIASES:
        return DTYPE_ALIASES[v]
    choices = "float32, bfloat16, float16" + (" or auto" if allow_auto else "")
    raise ConfigError(f"unknown dtype {value!r} for {field_name}; choose {choices}")


@dataclass
class EngineSpec:
    """The inference side (behavior policy).

    Engine-specific settings default to ``None``: "whatever the engine does by default", resolved
    and recorded by the engine itself. A setting the chosen engine does not have is an error, never
    silently ignored (see :data:`mismatch_probe.engines.EngineEntry.settings`).
    """

    name: str = "hf"
    python: str | None = None  # interpreter of the engine worker (a venv with the engine installed)
    dtype: str = "auto"  # auto: the checkpoint's own dtype
    # None: the engine's own default, resolved by validate() (raw for hf and vLLM; processed,
    # i.e. log_softmax(logits / T), for SGLang)
    logprobs_mode: str | None = None
    # MoE: record each token's top-k experts per layer (2 * layers * k bytes a token, each side)
    record_routing: bool = True
    # re-score the sampled sequences with the engine's own prefill (decode-vs-prefill mismatch)
    prefill_check: bool = True
    # hf
    device: str = "auto"
    attn_implementation: str | None = None  # hf default: auto (sdpa where the architecture supports it, else eager)
    batch_size: int | None = None  # hf default: 32
    # vllm / sglang
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None  # True: no torch.compile, no CUDA graphs
    cascade_attn: bool | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None  # SGLang: the radix cache
    # batch-invariant kernels: vLLM VLLM_BATCH_INVARIANT=1, SGLang enable_deterministic_inference
    batch_invariant: bool = False
    max_num_seqs: int | None = None  # SGLang: max_running_requests
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None  # SGLang: mem_fraction_static
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None  # SGLang: context_length
    # vLLM: the KV cache's size in bytes (per rank); on its CPU build mismatch-probe picks one that fits
    kv_cache_memory_bytes: int | None = None
    # sglang
    attention_backend: str | None = None  # e.g. flashinfer, fa3, triton, torch_native
    rl_on_policy_target: str | None = None  # e.g. "fsdp": SGLang's kernels chosen to match that trainer
    logits_fp32: bool | None = None  # enable_fp32_lm_head
    max_total_tokens: int | None = None  # KV-cache size in tokens (a memory cap)
    # any other engine argument, by the engine's own name (vLLM: EngineArgs fields; SGLang: ServerArgs fields)
    extra_args: dict = field(default_factory=dict)


@dataclass
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    max_tokens: int = 256
    n: int = 1
    seed: int = 0


@dataclass
class ReferenceSpec:
    """The training side: a full-sequence forward as a trainer computes it."""

    dtype: str = "bfloat16"
    logits_fp32: bool = False
    attn_implementation: str = "auto"  # sdpa where the architecture supports it, else eager
    packing: bool = True  # padding-free: sequences concatenated, position ids restart per sequence
    micro_batch_size: int = 16  # sequences per forward
    max_tokens_per_micro_batch: int = 4096  # packed mode: token budget per forward
    device: str = "auto"
    # training layouts (one process per rank, torch.distributed): Ulysses sequence parallelism
    # shards the packed row across ranks; tensor parallelism shards attention and MLP weights
    # (DTensor, the model's own column/row-wise plan). world size = sequence x tensor.
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # which distribution the reference scores under: "engine" (the same as the engine's log-probs,
    # the only comparable choice), or deliberately "raw", "temperature" (logits / T only, as
    # verl's actor does), "processed" (temperature, top-k, top-p)
    logprobs: str = "engine"


REFERENCE_LOGPROBS = ("engine", "raw", "temperature", "processed")
# what each engine returns when nobody asks: SGLang's sampler gives log_softmax(logits / T)
ENGINE_DEFAULT_LOGPROBS_MODE = {"sglang": "processed"}


@dataclass
class ProbeSpec:
    model: str | None = None
    prompts: str | None = None
    out: str | None = None
    name: str | None = None
    max_prompts: int | None = None
    shard_size: int = 256  # samples per rollout/token shard (the unit of resume)
    max_turns: int = 1  # assistant turns per sample; > 1 runs tool calls between turns
    trust_remote_code: bool = False
    engine: EngineSpec = field(default_factory=EngineSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    reference: ReferenceSpec = field(default_factory=ReferenceSpec)
    corrections: CorrectionThresholds = field(default_factory=CorrectionThresholds)
    # [[variants]]: reference (and correction) settings to score the same rollouts with, one run
    # each; every entry is {"name": ..., "reference": {...}, "corrections": {...}}
    variants: list = field(default_factory=list)
    # The run uses absolute paths; run.json records them as the user gave them (in a spec file:
    # relative to it; as flags: as typed), so a record carries no machine's directory layout.
    # {"model": "../fixtures/models/tiny-qwen2", "engine.python": ...}; not part of any fingerprint.
    given_paths: dict = field(default_factory=dict, repr=False, compare=False)

    def _resolved_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("given_paths")
        return d

    def to_dict(self) -> dict:
        """The spec as run.json records it: paths as given (others relative to the working
        directory when under it), every other value as the run uses it."""
        from mismatch_probe.files import portable_path

        d = self._resolved_dict()
        for dotted in PATH_FIELDS + ("engine.python",):
            section, _, key = dotted.rpartition(".")
            target = d[section] if section else d
            if target.get(key) is None:
                continue
            given = self.given_paths.get(dotted)
            # a bare interpreter name (python3) is looked up on PATH: keep it as typed
            target[key] = (
                given if given is not None else (portable_path(target[key]) if "/" in target[key] else target[key])
            )
        return d

    def rollout_fingerprint(self) -> str:
        """Hash of what decides the rollouts (model, prompts, engine, sampling), not how they are scored."""
        return rollout_fingerprint(self._resolved_dict())

    def expand_variants(self, base_out: Path) -> list[tuple[str, ProbeSpec]]:
        """One spec per ``[[variants]]`` entry, writing to ``base_out/<variant name>``."""
        out = []
        for v in self.variants:
            given = {k: p for k, p in self.given_paths.items() if k != "out"}
            spec = dataclasses.replace(
                copy.deepcopy(self),
                variants=[],
                out=str(Path(base_out) / v["name"]),
                name=f"{self.name}-{v['name']}" if self.name else v["name"],
                given_paths=given,
            )
            for section in VARIANT_SECTIONS:
                if v.get(section):
                    try:
                        setattr(spec, section, dataclasses.replace(getattr(spec, section), **v[section]))
                    except ValueError as exc:  # CorrectionThresholds validates itself
                        raise ConfigError(f"variant {v['name']!r}: [{section}] {exc}") from None
            out.append((v["name"], spec))
        return out

    def fingerprint(self) -> str:
        """Hash of everything that changes the results (not where they are written)."""
        d = self._resolved_dict()
        d.pop("out", None)
        d.pop("name", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> ProbeSpec:
        """Normalize aliases and check every field; raises :class:`ConfigError`."""
        if not self.model:
            raise ConfigError("no model given", hint="pass --model PATH or set model = ... in the spec file")
        if not self.prompts:
            raise ConfigError(
                "no prompts file given", hint="pass --prompts FILE.jsonl or set prompts = ... in the spec file"
            )
        e, s, r = self.engine, self.sampling, self.reference
        e.dtype = normalize_dtype(e.dtype, field_name="the engine (--engine-dtype)", allow_auto=True)
        r.dtype = normalize_dtype(r.dtype, field_name="the reference (--train-dtype)", allow_auto=False)
        for side, spec in (("engine", e), ("reference", r)):
            if spec.attn_implementation is not None:
                _choice(spec.attn_implementation, ATTN_IMPLEMENTATIONS, f"{side}.attn_implementation")
            _choice(spec.device, DEVICES, f"{side}.device")
        _choice(r.logprobs, REFERENCE_LOGPROBS, "reference.logprobs")
        if e.logprobs_mode is None:
            e.logprobs_mode = ENGINE_DEFAULT_LOGPROBS_MODE.get(e.name, "raw")
        _choice(e.logprobs_mode, LOGPROBS_MODES, "engine.logprobs_mode")
        if s.top_k == -1:
            s.top_k = 0
        _check(s.temperature >= 0, f"sampling.temperature must be >= 0, got {s.temperature}")
        _check(0 < s.top_p <= 1, f"sampling.top_p must be in (0, 1], got {s.top_p}")
        _check(s.top_k >= 0, f"sampling.top_k must be >= 0 (0 or -1 disables it), got {s.top_k}")
        _check(s.max_tokens >= 1, f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
        _check(s.n >= 1, f"sampling.n must be >= 1, got {s.n}")
        for name in (
            "batch_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_total_tokens",
            "kv_cache_memory_bytes",
        ):
            value = getattr(e, name)
            _check(value is None or value >= 1, f"engine.{name} must be >= 1, got {value}")
        _check(e.tensor_parallel_size >= 1, f"engine.tensor_parallel_size must be >= 1, got {e.tensor_parallel_size}")
        _check(
            e.gpu_memory_utilization is None or 0 < e.gpu_memory_utilization <= 1,
            f"engine.gpu_memory_utilization must be in (0, 1], got {e.gpu_memory_utilization}",
        )
        if e.python is not None and "/" not in e.python:
            e.python = shutil.which(e.python) or e.python
        if e.python is not None and not Path(e.python).is_file():
            raise ConfigError(
                f"engine.python {e.python!r} does not exist",
                hint="give the python of a venv that has the engine and mismatch-probe installed, e.g. /opt/vllm/bin/python",
            )
        _check(r.micro_batch_size >= 1, f"reference.micro_batch_size must be >= 1, got {r.micro_batch_size}")
        _check(r.max_tokens_per_micro_batch >= 1, "reference.max_tokens_per_micro_batch must be >= 1")
        _check(
            r.sequence_parallel_size >= 1,
            f"reference.sequence_parallel_size must be >= 1, got {r.sequence_parallel_size}",
        )
        _check(
            r.tensor_parallel_size >= 1, f"reference.tensor_parallel_size must be >= 1, got {r.tensor_parallel_size}"
        )
        if r.sequence_parallel_size > 1:
            if not r.packing:
                raise ConfigError(
                    "Ulysses sequence parallelism (--train-sp) shards one packed row across ranks; "
                    "padded micro-batches have no packed row",
                    hint="use --packing (reference.packing = true)",
                )
            _check(
                r.attn_implementation in SP_ATTN_IMPLEMENTATIONS + ("auto",),
                f"reference.attn_implementation {r.attn_implementation!r} cannot run under sequence parallelism "
                f"(it needs a mask over the whole row); choose {' or '.join(SP_ATTN_IMPLEMENTATIONS)}",
            )
        _check(self.shard_size >= 1, f"shard_size must be >= 1, got {self.shard_size}")
        _check(self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}")
        _check(self.max_prompts is None or self.max_prompts >= 1, "max_prompts must be >= 1")
        if e.logprobs_mode == "processed" and s.temperature == 0:
            # Greedy decoding has no processed distribution; both sides then use raw logits.
            e.logprobs_mode = "raw"
        for name, variant in self.expand_variants(Path(".")):
            try:
                variant.validate()
            except ConfigError as exc:
                raise ConfigError(f"variant {name!r}: {exc.message}", hint=exc.hint) from None
        return self


ROLLOUT_KEYS = ("model", "prompts", "max_prompts", "shard_size", "max_turns", "trust_remote_code", "engine", "sampling")
VARIANT_SECTIONS = ("reference", "corrections")
VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def rollout_fingerprint(spec_dict: dict) -> str:
    """:meth:`ProbeSpec.rollout_fingerprint` of a stored spec (a run.json's ``spec``)."""
    d = {k: spec_dict.get(k) for k in ROLLOUT_KEYS}
    # where the engine ran from does not change what it sampled (run.json records its versions)
    d["engine"] = {k: v for k, v in (d["engine"] or {}).items() if k != "python"}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(value: str, choices: tuple, name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} is {value!r}; choose one of {', '.join(choices)}")


SECTIONS = {
    "engine": EngineSpec,
    "sampling": SamplingSpec,
    "reference": ReferenceSpec,
    "corrections": CorrectionThresholds,
}
PATH_FIELDS = ("model", "prompts", "out")


def _coerce(value: Any, f: dataclasses.Field, where: str) -> Any:
    """Check a TOML/flag value against the dataclass field's type (no silent coercion)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{where} cannot be empty")
    if kind.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if kind.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if kind.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if kind.startswith("dict"):
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{where} must be a table, got {value!r}")
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{where} must be a single value, got {type(value).__name__}")
    return str(value)


def unknown_key(key: str, known, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{where}: unknown key {key!r}", hint=hint)


def _variants(value: Any, source: str) -> list[dict]:
    """``[[variants]]``: each a name and reference/corrections settings, checked like the sections."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{source}: variants must be an array of tables ([[variants]])")
    out, names = [], set()
    for i, v in enumerate(value):
        where = f"{source}: variants[{i}]"
        name = v.get("name")
        if not isinstance(name, str) or not VARIANT_NAME.match(name):
            raise ConfigError(f"{where} needs a name of letters, digits, '.', '_' or '-' (it names its run directory)")
        if name in names:
            raise ConfigError(f"{where}: the name {name!r} is used twice")
        names.add(name)
        entry = {"name": name}
        for key, settings in v.items():
            if key == "name":
                continue
            if key not in VARIANT_SECTIONS:
                raise ConfigError(
                    f"{where}: {key!r} cannot vary between variants, which score the same rollouts",
                    hint="a variant sets [reference] and [corrections] settings; give other settings a spec of their own",
                )
            if not isinstance(settings, dict):
                raise ConfigError(f"{where}: {key} must be a table")
            fields = {f.name: f for f in dataclasses.fields(SECTIONS[key])}
            for sub in settings:
                if sub not in fields:
                    raise unknown_key(sub, fields, f"{where}.{key}")
            entry[key] = {sub: _coerce(x, fields[sub], f"{where}.{key}.{sub}") for sub, x in settings.items()}
        out.append(entry)
    if len(out) == 1:
        raise ConfigError(f"{source}: one variant compares nothing", hint="give two or more [[variants]], or none")
    return out


def spec_from_dict(data: dict, *, base_dir: Path | None = None, source: str = "spec") -> ProbeSpec:
    """Build a spec from nested dicts (a parsed TOML file); unknown keys are errors."""
    spec = ProbeSpec()
    top_fields = {f.name: f for f in dataclasses.fields(ProbeSpec) if f.name not in SECTIONS}
    for key, value in data.items():
        if key == "variants":
            spec.variants = _variants(value, source)
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            section = getattr(spec, key)
            fields = {f.name: f for f in dataclasses.fields(section)}
            updates = {}
            for sub, v in value.items():
                if sub not in fields:
                    raise unknown_key(sub, fields, f"{source} [{key}]")
                updates[sub] = _coerce(v, fields[sub], f"{source}: {key}.{sub}")
            if key == "engine" and updates.get("python") and base_dir is not None and "/" in updates["python"]:
                spec.given_paths["engine.python"] = updates["python"]
                updates["python"] = os.path.abspath(base_dir / updates["python"])  # not resolve(): venv symlinks
            try:
                setattr(spec, key, dataclasses.replace(section, **updates))
            except ValueError as exc:  # CorrectionThresholds validates itself
                raise ConfigError(f"{source}: [{key}] {exc}") from None
        elif key in top_fields:
            v = _coerce(value, top_fields[key], f"{source}: {key}")
            if key in PATH_FIELDS and v is not None and base_dir is not None:
                spec.given_paths[key] = v
                v = str((base_dir / v).resolve()) if not Path(v).is_absolute() else v
            setattr(spec, key, v)
        else:
            raise unknown_key(key, list(top_fields) + list(SECTIONS), source)
    return spec


def load_spec_file(path: str | Path) -> ProbeSpec:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"spec file {str(p)!r} is a directory", hint="give a probe spec (TOML), e.g. probes/demo.toml"
        )
    try:
        data = tomllib.loads(read_text(p, "spec file"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML ({exc})") from None
    spec = spec_from_dict(data, base_dir=p.resolve().parent, source=str(p))
    spec.given_paths["spec_file"] = str(p)  # as typed; run.json names the file it came from
    return spec


def apply_overrides(spec: ProbeSpec, overrides: dict[str, Any]) -> ProbeSpec:
    """Apply ``{"field": v}`` / ``{"section.field": v}`` overrides (CLI flags); ``None`` means unset."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        section_name, _, leaf = dotted.rpartition(".")
        target = getattr(spec, section_name) if section_name else spec
        fields = {f.name: f for f in dataclasses.fields(target)}
        if leaf not in fields:
            raise unknown_key(leaf, fields, "override")
        coerced = _coerce(value, fields[leaf], f"--{dotted.replace('.', '-').replace('_', '-')}")
        if dotted in PATH_FIELDS or (dotted == "engine.python" and "/" in coerced):
            spec.given_paths[dotted] = coerced  # as typed, relative to the working directory
            # not resolve() for the python: a venv's bin/python is a symlink whose target is not the venv
            coerced = os.path.abspath(coerced) if dotted == "engine.python" else str(Path(coerced).resolve())
        if not section_name:
            setattr(spec, leaf, coerced)
            continue
        try:
            setattr(spec, section_name, dataclasses.replace(target, **{leaf: coerced}))
        except ValueError as exc:
            raise ConfigError(f"{dotted}: {exc}") from None
    return spec
