"""The known mismatch risks of an RL stack's configuration, each with its evidence.

A :class:`Risk` looks at a :class:`~mismatch_probe.frameworks.base.StackReading` (the probe settings
read from the framework's config, and the framework facts its module adds) and says, in one line
that cites the values, whether this configuration has it. `mismatch-probe init` prints what it
finds, writes it into the spec's ``[stack]`` table, and the run's report shows it.

The engine bugs this project found (docs/engine-findings/) are risks too, for the engine and model
family they affect: :data:`ENGINE_FINDINGS` declares them, one per finding page
(``tests/unit/test_stack_risks.py`` checks that every page has its entry).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.config.stack_spec import StackRisk
from mismatch_probe.frameworks.base import StackReading

FRAMEWORK_PAGE = "docs/frameworks/{framework}.md"
CASCADE_ISSUE = "https://github.com/vllm-project/vllm/issues/17652"


@dataclass(frozen=True)
class Risk:
    id: str
    title: str
    evidence: str  # may name {framework}, filled with the config's
    check: Callable[[StackReading], str | None]  # the detail, citing the values, when the config has it

    def find(self, stack: StackReading) -> StackRisk | None:
        detail = self.check(stack)
        if detail is None:
            return None
        evidence = stack.fact(f"evidence:{self.id}") or self.evidence.format(framework=stack.framework)
        return StackRisk(id=self.id, title=self.title, detail=detail, evidence=evidence)


def _engine(stack: StackReading) -> str:
    return str(stack.value("engine.name", "vllm"))


def _engine_logprobs(stack: StackReading) -> str:
    """What the engine's log-probs describe: the mode set, else the engine's own default (vLLM's
    raw_logprobs, SGLang's log_softmax(logits / T), config/choices.py)."""
    from mismatch_probe.config.choices import default_logprobs_mode

    mode = stack.value("engine.logprobs_mode")
    return str(mode) if mode is not None else default_logprobs_mode(_engine(stack))


def _truncated(stack: StackReading) -> bool:
    return float(stack.value("sampling.top_p", 1.0)) < 1.0 or int(stack.value("sampling.top_k", 0) or 0) > 0


def _logprobs_temperature(stack: StackReading) -> str | None:
    t = float(stack.value("sampling.temperature", 1.0))
    engine, trainer = _engine_logprobs(stack), stack.value("reference.logprobs", "engine")
    if t in (0.0, 1.0) or trainer in (None, "engine"):
        return None
    # raw: log_softmax(logits); processed and the trainer's "temperature": of logits / T
    engine_scaled = engine == "processed"
    trainer_scaled = trainer in ("temperature", "processed")
    if engine_scaled == trainer_scaled:
        return None
    how = {True: "log_softmax(logits / T)", False: "log_softmax(logits)"}
    mode = stack.values.get("engine.logprobs_mode")
    if mode is None:
        set_or_default = f"{_engine(stack)}'s default"
    elif all(o.from_user for o in mode.origins):
        set_or_default = "as the config sets it"
    else:
        set_or_default = f"as {stack.framework} asks for it"
    return (
        f"at temperature {t:g} the engine returns {engine} log-probs ({set_or_default}: {how[engine_scaled]}) "
        f"while the trainer scores {how[trainer_scaled]}: every token's ratio is off by the temperature, "
        "not by numerics"
    )


def _truncation(stack: StackReading) -> str | None:
    if not _truncated(stack):
        return None
    p, k = stack.value("sampling.top_p", 1.0), stack.value("sampling.top_k", 0)
    engine, trainer = _engine_logprobs(stack), stack.value("reference.logprobs", "engine")
    trainer_renorm = stack.fact("trainer_renormalizes_truncation", trainer == "processed")
    engine_renorm = engine == "processed"
    sides = (
        f"the engine's log-probs are {'renormalised over the kept tokens' if engine_renorm else 'of the full distribution'}, "
        f"the trainer's {'renormalised' if trainer_renorm else 'of the full distribution'}"
    )
    if engine_renorm != trainer_renorm:
        verdict = "they disagree on every token"
    elif not engine_renorm:
        verdict = (
            "both score the full distribution while the tokens are drawn from the truncated one, so the "
            "ratio a correction uses leaves the truncation out"
        )
    else:
        verdict = "both renormalise; whether over the same kept set is what a run at this top-p checks"
    return f"sampling is truncated (top-p {p:g}, top-k {k}): {sides}; {verdict}"


def _one_sided_fp32_head(stack: StackReading) -> str | None:
    engine = bool(stack.fact("engine_lm_head_fp32", stack.value("engine.logits_fp32", False)))
    trainer = bool(stack.value("reference.logits_fp32", False))
    if engine == trainer:
        return None
    fp32, other = ("engine", "trainer") if engine else ("trainer", "engine")
    return (
        f"the {fp32} computes the LM head in float32 and the {other} does not: the logits differ by the "
        "head's rounding on every token, most where the distribution is flat"
    )


def pinned_version(pin: str | None) -> tuple[int, ...] | None:
    """The newest version a pin allows (``vllm>=0.8.5,<=0.12.0`` -> (0, 12, 0)), None without a number."""
    found = [tuple(int(p) for p in v.split(".")) for v in re.findall(r"\d+\.\d+(?:\.\d+)?", pin or "")]
    return max(found) if found else None


# vLLM 0.32 removed cascade attention (engines/vllm_args.py); V1 ran it by default before
CASCADE_REMOVED = (0, 32)


def _cascade(stack: StackReading) -> str | None:
    if _engine(stack) != "vllm" or stack.value("engine.cascade_attn") is False:
        return None
    version = pinned_version(stack.engine_pin)
    if version is not None and version >= CASCADE_REMOVED:
        return None
    n = int(stack.value("sampling.n", 1))
    shared = f"{n} samples per prompt share each prompt's prefix" if n > 1 else "requests that share a prefix"
    return (
        f"cascade attention is left on (vLLM's default before 0.32: disable_cascade_attn=False) and {shared}, "
        "the case where vLLM's V1 FlashAttention backend runs it; set disable_cascade_attn=True "
        "(engine.cascade_attn = false)"
    )


def _precision(stack: StackReading) -> str | None:
    engine = stack.value("engine.dtype", "auto")
    if stack.value("reference.fsdp", False):
        trainer, what = stack.value("reference.fsdp_param_dtype", "bfloat16"), "FSDP param_dtype"
    else:
        trainer, what = stack.value("reference.dtype", "bfloat16"), "dtype"
    from mismatch_probe.config.choices import DTYPE_ALIASES

    engine, trainer = DTYPE_ALIASES.get(str(engine), str(engine)), DTYPE_ALIASES.get(str(trainer), str(trainer))
    if "auto" in (engine, trainer) or engine == trainer or {engine, trainer} == {"bfloat16", "float32"}:
        return None  # bf16 against fp32 compute is the usual and measured case; fp16 against bf16 is not
    return f"the engine computes in {engine} and the trainer's {what} is {trainer}: two roundings, not one"


def _colocate_reload(stack: StackReading) -> str | None:
    return stack.fact("colocate_reload_weights")


def _sampling_disagrees(stack: StackReading) -> str | None:
    lines = []
    for name, key in (("temperature", "sampling.temperature"), ("top_p", "sampling.top_p")):
        trainer = stack.fact(f"trainer_{name}")
        if trainer is not None and float(trainer) != float(stack.value(key, 1.0)):
            lines.append(
                f"the engine samples at {name} {stack.value(key):g} but the trainer scores at {float(trainer):g}"
            )
    return "; ".join(lines) or None


def pinned_releases(engine: str, pin: str) -> list[str]:
    """The surveyed releases of ``engine`` (engines/api_surface) that a framework's pin allows: a
    requirement (``vllm>=0.8.5,<=0.12.0``), or the version an image tag or ``==`` names."""
    from packaging.requirements import InvalidRequirement, Requirement

    from mismatch_probe.engines.api_uses import surface, version_key

    releases = surface(engine)["releases"]
    text = pin.split(" (")[0].strip()
    try:
        spec = Requirement(text).specifier
    except InvalidRequirement:
        spec = None
    if spec:
        return [r for r in releases if spec.contains(r, prereleases=True)]
    named = re.findall(r"\d+\.\d+\.\d+(?:\.post\d+)?", text)
    keys = {version_key(v) for v in named}
    return [r for r in releases if version_key(r) in keys]


def _engine_version(stack: StackReading) -> str | None:
    from mismatch_probe.engines.api_uses import SUPPORTED, version_warning

    engine = _engine(stack)
    if engine not in SUPPORTED or not stack.engine_pin:
        return None
    allowed = pinned_releases(engine, stack.engine_pin)
    outside = [r for r in allowed if version_warning(engine, r)]
    if not outside:
        return None
    lo, hi = SUPPORTED[engine]
    inside = [r for r in allowed if r not in outside]
    lacks = version_warning(engine, outside[-1]) or ""
    lacks = lacks.split(": ", 1)[1] if ": " in lacks else lacks
    runs = (
        f"of them only {', '.join(inside)} {'runs' if len(inside) == 1 else 'run'}" if inside else "none of them runs"
    )
    return (
        f"{stack.framework} pins {stack.engine_pin}; {runs} mismatch-probe's in-process {engine} adapter "
        f"(it supports {lo}–{hi}; {outside[-1]} is {lacks}): probe with a supported {engine}, or "
        "through the framework's own server (--engine-url)"
    )


RISKS: tuple[Risk, ...] = (
    Risk(
        "engine-version",
        "the engine version the framework pins is outside what the probe's adapter runs",
        "mismatch_probe/engines/api_surface (each release's API, read by scripts/engine_api_surface.py); "
        "docs/concepts/engines.md, Supported engine versions",
        _engine_version,
    ),
    Risk(
        "logprobs-temperature",
        "engine and trainer log-probs at different temperatures",
        "{framework}: " + FRAMEWORK_PAGE + " (log-prob mode); vLLM's logprobs_mode (vllm/config/model.py)",
        _logprobs_temperature,
    ),
    Risk(
        "truncated-sampling",
        "top-p / top-k sampling: renormalised or full-distribution log-probs",
        FRAMEWORK_PAGE + "; vLLM's processed_logprobs are taken after top-k/top-p (vllm/v1/sample/sampler.py)",
        _truncation,
    ),
    Risk(
        "one-sided-fp32-head",
        "the LM head in float32 on one side only",
        "MiniMax-M1 technical report (arXiv:2506.13585), §3: the LM head's precision caused the "
        "training/inference probability mismatch; " + FRAMEWORK_PAGE,
        _one_sided_fp32_head,
    ),
    Risk(
        "cascade-attention",
        "vLLM cascade attention on shared prefixes",
        f"{CASCADE_ISSUE}; verl's FAQ gives disable_cascade_attn=True as the fix for a high rollout_probs_diff_mean",
        _cascade,
    ),
    Risk(
        "precision-differs",
        "engine and trainer compute in different 16-bit formats",
        "docs/how-to/precision.md (the precision sweep: float16 against bfloat16)",
        _precision,
    ),
    Risk(
        "colocate-reload",
        "the colocated engine reloads weights after a sync",
        FRAMEWORK_PAGE,
        _colocate_reload,
    ),
    Risk(
        "sampling-disagrees",
        "engine and trainer use different sampling parameters",
        FRAMEWORK_PAGE,
        _sampling_disagrees,
    ),
)


# ---- engine bugs this project found, by engine and model family ---------------------------------


@dataclass(frozen=True)
class EngineFinding:
    page: str  # docs/engine-findings/<page>.md
    engine: str
    title: str
    model_types: frozenset[str] | None  # None: every model
    found_on: str  # the engine version it was found on
    when: Callable[[StackReading, dict], bool] | None = None  # a further condition on the config / model config
    cpu_only: bool = False  # a bug of the engine's CPU build: not a risk on GPUs

    @property
    def id(self) -> str:
        return f"engine-finding:{self.page}"


ENGINE_FINDINGS: tuple[EngineFinding, ...] = (
    EngineFinding(
        "sglang-last-vocab-id-reported-as-0",
        "sglang",
        "SGLang reports the last vocabulary id as token 0 in prompt log-probs",
        None,
        "SGLang 0.5.23",
    ),
    EngineFinding(
        "sglang-torch-native-attention-softcap",
        "sglang",
        "SGLang's torch_native attention drops Gemma-2's attention soft-cap",
        frozenset({"gemma2"}),
        "SGLang 0.5.23",
        when=lambda stack, _: stack.value("engine.attention_backend") == "torch_native",
    ),
    EngineFinding(
        "sglang-mistral-sliding-window",
        "sglang",
        "SGLang ignores Mistral's sliding window",
        frozenset({"mistral"}),
        "SGLang 0.5.23",
        when=lambda _, cfg: cfg.get("sliding_window") is not None if cfg else True,
    ),
    EngineFinding(
        "sglang-qwen3-moe-untied-lm-head",
        "sglang",
        "SGLang never loads a tied MoE checkpoint's LM head",
        frozenset({"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"}),
        "SGLang 0.5.23",
        when=lambda _, cfg: bool(cfg.get("tie_word_embeddings", True)) if cfg else True,
    ),
    EngineFinding(
        "vllm-cpu-deepseek-v3-mla",
        "vllm",
        "vLLM's CPU build mis-rotates DeepSeek-V3's MLA query and key",
        frozenset({"deepseek_v3"}),
        "vLLM 0.32.0 (CPU build)",
        cpu_only=True,
    ),
)

# what a model's name says of its Hugging Face model_type, where the config holds a hub id and not a
# local checkpoint (most specific first)
_NAME_TYPES: tuple[tuple[str, str], ...] = (
    (r"qwen3.*(moe|a3b|a22b|-a\d+b)", "qwen3_moe"),
    (r"qwen1\.5-moe|qwen2-moe|qwen2-57b-a14b", "qwen2_moe"),
    (r"qwen3", "qwen3"),
    (r"qwen2|qwen-2|qwq", "qwen2"),
    (r"deepseek-v3|deepseek-r1(?!-distill)|kimi-k2", "deepseek_v3"),
    (r"mixtral", "mixtral"),
    (r"mistral|ministral", "mistral"),
    (r"gemma-?2", "gemma2"),
    (r"gemma-?3", "gemma3"),
    (r"glm-4\.5|glm4\.5|glm-4\.6", "glm4_moe"),
    (r"olmo-?2", "olmo2"),
    (r"llama", "llama"),
)


def model_config(stack: StackReading, model_dir: Path | None = None) -> tuple[str | None, dict]:
    """The model's ``model_type`` and its config: from ``config.json`` of a local checkpoint (the
    one given, or the config's model path where it exists here), else guessed from the model's name."""
    candidates = [model_dir] if model_dir is not None else []
    if stack.model is not None:
        candidates.append(Path(str(stack.model.value)).expanduser())
    for d in candidates:
        cfg_file = d / "config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            return cfg.get("model_type"), cfg
    name = str(stack.model.value).lower() if stack.model is not None else ""
    return next((t for pattern, t in _NAME_TYPES if re.search(pattern, name)), None), {}


def _finding_risk(finding: EngineFinding, stack: StackReading, model_type: str | None, cfg: dict) -> StackRisk | None:
    if finding.cpu_only or _engine(stack) != finding.engine:
        return None
    if finding.model_types is not None and model_type not in finding.model_types:
        return None
    if finding.when is not None and not finding.when(stack, cfg):
        return None
    pin = f"; this stack pins {stack.engine_pin}, where it was not checked" if stack.engine_pin else ""
    family = f"{model_type} on " if finding.model_types is not None else ""
    return StackRisk(
        id=finding.id,
        title=finding.title,
        detail=f"{family}{finding.engine}: found on {finding.found_on}{pin}",
        evidence=f"docs/engine-findings/{finding.page}.md",
    )


def find_risks(stack: StackReading, model_dir: Path | None = None) -> list[StackRisk]:
    """Every known risk this configuration has, the general ones first, then the engine findings."""
    found = [r for risk in RISKS if (r := risk.find(stack)) is not None]
    model_type, cfg = model_config(stack, model_dir)
    found += [r for f in ENGINE_FINDINGS if (r := _finding_risk(f, stack, model_type, cfg)) is not None]
    return found
