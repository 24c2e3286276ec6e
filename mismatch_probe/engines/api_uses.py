"""The engine APIs the in-process adapters use, declared once, and the engine releases they run on.

Each adapter's uses (:data:`USES`) name what it passes to, calls on or reads from its engine, by
kind (:data:`KINDS`): ``EngineArgs`` / ``ServerArgs`` fields (derived from the spec's declarations,
``config/spec.py: engine_arguments``, plus what the adapter passes by hand), sampling parameters,
engine methods, output fields, environment variables, imported names. A use is needed by every run
(``needed_for`` None) or only by one feature, and is *gated* where the adapter copes with a release
that lacks it: ``fallback`` says how (it refuses the setting by name, or takes another path), and
``since`` / ``until`` say which releases the code uses it on at all (its own version check).

``api_surface/<engine>.json`` (written by ``scripts/engine_api_surface.py`` from each release's own
sources, never imported) says in which releases each name exists. A release is supported where
every ungated use of every run exists (:func:`derive_supported`); :data:`SUPPORTED` declares the
result (tests/unit/test_engine_api_surface.py checks it, and that the adapters' code uses nothing
undeclared). :func:`version_warning` is the line a run on another release records.
Light to import: no engine is imported here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SURFACE_DIR = Path(__file__).parent / "api_surface"
# each engine's package name as its adapter reports it (info()["versions"]) and its name in messages
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}

# what each kind of name is, per engine: where scripts/engine_api_surface.py reads it in a release
KINDS: dict[str, dict[str, str]] = {
    "vllm": {
        "engine_args": "EngineArgs fields (vllm/engine/arg_utils.py)",
        "sampling_params": "SamplingParams fields (vllm/sampling_params.py)",
        "llm": "LLM methods and attributes (vllm/entrypoints/llm.py)",
        "request_output": "RequestOutput attributes (vllm/outputs.py)",
        "completion_output": "CompletionOutput fields (vllm/outputs.py)",
        "logprobs_modes": "LogprobsMode values (vllm/config)",
        "worker": "Worker methods reached by collective_rpc (vllm/v1/worker/gpu_worker.py)",
        "envs": "environment variables the adapter sets (string literals in vllm/)",
        "symbols": "names the adapters import, as module:name",
    },
    "sglang": {
        "server_args": "ServerArgs fields (sglang/srt/server_args.py)",
        "engine": "Engine methods (sglang/srt/entrypoints/engine.py)",
        "generate_args": "Engine.generate parameters",
        "sampling_params": "SamplingParams parameters (sglang/srt/sampling/sampling_params.py)",
        "meta_info": "meta_info keys the adapter reads (string literals in sglang/srt)",
        "envs": "environment variables the adapter sets (string literals in sglang/)",
        "routes": "HTTP routes (sglang/srt/entrypoints/http_server.py)",
        "symbols": "names the adapters import, as module:name",
    },
}


@dataclass(frozen=True)
class Use:
    """One name an adapter uses. ``needed_for``: None for every run, else the feature that needs it
    (a setting, ``[sync]``, ``CPU``); ``fallback``: what the adapter does on a release without it
    (None: it fails there); ``since`` / ``until``: the releases on which the adapter uses it at all
    (``until`` exclusive), by its own version check."""

    kind: str
    name: str
    needed_for: str | None = None
    fallback: str | None = None
    since: str | None = None
    until: str | None = None

    def gated(self) -> bool:
        return self.fallback is not None or self.needed_for is not None

    def used_on(self, release: str) -> bool:
        key = version_key(release)
        return (self.since is None or key >= version_key(self.since)) and (
            self.until is None or key < version_key(self.until)
        )


REFUSED_BY_NAME = "refused by name where the release lacks the argument (the adapter checks the release's own fields)"
SKIPPED_UNKNOWN = "passed only where the release has the argument"


def _vllm_uses() -> tuple[Use, ...]:
    from mismatch_probe.config.spec import EngineSpec
    from mismatch_probe.engines.vllm_args import ADDRESS_ARGS, ARGS, LOGPROBS_MODE, ONLY_WHEN_SET

    def passed_always(field: str) -> bool:  # engine_args passes it in every run
        return field == "dtype" or (EngineSpec.model_fields[field].default is not None and field not in ONLY_WHEN_SET)

    uses = [
        Use("engine_args", arg, *((None, None) if passed_always(f) else (f"engine.{f}", REFUSED_BY_NAME)))
        for f, arg in ARGS.items()
    ]
    uses += [Use("engine_args", a, "engine.dist_init_addr", REFUSED_BY_NAME) for a in ADDRESS_ARGS]
    uses += [Use("engine_args", a) for a in ("model", "logprobs_mode", "trust_remote_code", "seed")]
    uses += [
        # every single-node run sets it: its workers report the kernels they run (VLLMEngine.__init__)
        Use("engine_args", "worker_extension_cls"),
        Use("engine_args", "disable_cascade_attn", "engine.cascade_attn", until="0.32"),
        Use("engine_args", "enable_return_routed_experts", "engine.record_routing", "routing_refusal names it"),
        Use("engine_args", "enable_sleep_mode", "[sync] sleep_level"),
        Use("engine_args", "kv_cache_memory_bytes", "CPU"),  # the adapter sizes the CPU build's KV cache
    ]
    uses += [Use("logprobs_modes", mode) for mode in LOGPROBS_MODE.values()]
    uses += [Use("sampling_params", p) for p in SAMPLING_VLLM]
    uses += [Use("sampling_params", "routed_experts_prompt_start", "engine.record_routing")]
    uses += [Use("llm", m) for m in ("generate", "collective_rpc", "llm_engine")]
    uses += [Use("llm", m, "[sync]") for m in ("sleep", "wake_up", "reset_prefix_cache")]
    uses += [Use("request_output", a) for a in ("outputs", "prompt_token_ids", "prompt_logprobs")]
    uses += [Use("completion_output", a) for a in ("token_ids", "logprobs", "finish_reason")]
    uses += [Use("completion_output", "routed_experts", "engine.record_routing")]
    uses += [
        Use("worker", "reload_weights", "[sync] transfer disk"),
        Use("envs", "VLLM_BATCH_INVARIANT", "engine.batch_invariant"),
        Use("envs", "VLLM_CPU_OMP_THREADS_BIND", "CPU"),
        Use("symbols", "vllm:LLM"),
        Use("symbols", "vllm:SamplingParams"),
        Use("symbols", "vllm.engine.arg_utils:EngineArgs"),
        Use("symbols", "vllm.platforms:current_platform"),
        Use("symbols", "vllm.config:set_current_vllm_config", "[sync]"),
        Use("symbols", "vllm.model_executor.model_loader.reload.layerwise:initialize_layerwise_reload", "[sync]"),
        Use("symbols", "vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_reload", "[sync]"),
        Use("symbols", "vllm.utils.cpu_resource_utils:get_allowed_cpu_list", "CPU"),
        Use("symbols", "vllm.utils.cpu_resource_utils:get_memory_node_info", "CPU"),
    ]
    return tuple(uses)


# the SamplingParams every generate / prefill request passes (vllm.py)
SAMPLING_VLLM = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "seed",
    "stop_token_ids",
    "detokenize",
    "skip_special_tokens",
    "flat_logprobs",
)


def _sglang_uses() -> tuple[Use, ...]:
    from mismatch_probe.config.spec import LAYOUT_SETTINGS
    from mismatch_probe.engines.sglang_args import ARGS, CPU_DEFAULTS, CPU_IDLE_DEFAULTS, SET_APART

    uses = [Use("server_args", ARGS["device"]), Use("server_args", ARGS["dtype"], "engine.dtype")]
    uses += [Use("server_args", ARGS["chunked_prefill"], "engine.chunked_prefill")]
    uses += [
        Use("server_args", arg, f"engine.{f}", REFUSED_BY_NAME if f in LAYOUT_SETTINGS else None)
        for f, arg in ARGS.items()
        if f not in (*SET_APART, "dtype")
    ]
    uses += [Use("server_args", a) for a in ("model_path", "skip_tokenizer_init", "trust_remote_code", "log_level")]
    uses += [Use("server_args", "random_seed")]
    uses += [Use("server_args", a, "CPU") for a in (*CPU_DEFAULTS, "max_total_tokens") if a not in ARGS.values()]
    uses += [Use("server_args", a, "CPU", SKIPPED_UNKNOWN) for a in CPU_IDLE_DEFAULTS]
    uses += [
        Use("server_args", "enable_return_routed_experts", "engine.record_routing", "routing_refusal names it"),
        Use("server_args", "custom_weight_loader", "[sync]"),
        Use("server_args", "enable_memory_saver", "[sync] sleep_level"),
        Use("server_args", "enable_weights_cpu_backup", "[sync] sleep_level"),
    ]
    uses += [Use("engine", m) for m in ("generate", "get_server_info", "shutdown")]
    uses += [
        Use("engine", m, "[sync]")
        for m in (
            "update_weights_from_tensor",
            "update_weights_from_disk",
            "flush_cache",
            "begin_weight_update",
            "end_weight_update",
        )
    ]
    uses += [Use("engine", m, "[sync] sleep_level") for m in ("release_memory_occupation", "resume_memory_occupation")]
    uses += [Use("generate_args", a) for a in ("input_ids", "sampling_params", "return_logprob", "logprob_start_len")]
    uses += [
        Use("generate_args", a, "engine.record_routing") for a in ("return_routed_experts", "routed_experts_start_len")
    ]
    uses += [Use("sampling_params", p) for p in SAMPLING_SGLANG]
    uses += [Use("meta_info", k) for k in ("output_token_logprobs", "input_token_logprobs", "finish_reason")]
    uses += [Use("meta_info", "routed_experts", "engine.record_routing")]
    uses += [
        Use("envs", "SGLANG_RETURN_ORIGINAL_LOGPROB"),
        Use("envs", "SGLANG_USE_CPU_ENGINE", "CPU"),
        Use("envs", "SGLANG_CPU_OMP_THREADS_BIND", "CPU"),
        Use("symbols", "sglang:Engine"),
        Use("symbols", "sglang.srt.server_args:ServerArgs"),
        Use("symbols", "sglang.srt.utils:cpu_has_amx_support", "CPU"),
        Use("symbols", "sglang.srt.runtime_context:get_parallel", "[sync]", "tensor-parallel rank 0 is assumed"),
    ]
    return tuple(uses)


# the sampling parameters every generate / prefill request passes (sglang.py)
SAMPLING_SGLANG = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
)


@cache
def uses(engine: str) -> tuple[Use, ...]:
    """Every declared use of ``engine``'s adapter."""
    return {"vllm": _vllm_uses, "sglang": _sglang_uses}[engine]()


# The releases each adapter supports: every name an ordinary run needs exists (derive_supported).
SUPPORTED: dict[str, tuple[str, str]] = {"vllm": ("0.12.0", "0.33.0"), "sglang": ("0.5.3.post3", "0.5.23")}


def version_key(version: str) -> tuple[int, ...]:
    """A release's order: ``0.5.6.post2`` -> (0, 5, 6, 0, 2); a local tag (``+cpu``) and dev or rc
    suffixes are dropped."""
    base = version.split("+")[0].lower()
    post = re.search(r"\.?post(\d+)", base)
    release = re.split(r"\.?(?:post|dev|rc|a|b)\d*", base)[0]
    parts = [int(p) for p in release.split(".") if p.isdigit()]
    parts += [0] * (4 - len(parts))
    return (*parts[:4], int(post.group(1)) if post else 0)


@cache
def surface(engine: str) -> dict:
    """``api_surface/<engine>.json``: its releases, oldest first, and per kind each name's releases."""
    data = json.loads((SURFACE_DIR / f"{engine}.json").read_text())
    data["releases"] = sorted(data["releases"], key=version_key)
    return data


def releases_of(spans: str, releases: list[str]) -> set[str]:
    """The releases a surface entry names: ``"0.10.2..0.12.0,0.14.1"`` (spans over ``releases``)."""
    out: set[str] = set()
    for span in spans.split(","):
        first, _, last = span.partition("..")
        lo, hi = releases.index(first), releases.index(last or first)
        out.update(releases[lo : hi + 1])
    return out


def missing(engine: str, release: str, *, needed: bool = True) -> list[Use]:
    """The uses of ``engine``'s adapter whose name ``release`` (one of the surface's) lacks; with
    ``needed``, only those an ordinary run fails on (ungated, used on that release)."""
    data = surface(engine)
    out = []
    for use in uses(engine):
        spans = data["kinds"].get(use.kind, {}).get(use.name)
        present = spans is not None and release in releases_of(spans, data["releases"])
        if present or not use.used_on(release) or (needed and use.gated()):
            continue
        out.append(use)
    return out


def derive_supported(engine: str) -> tuple[str, str]:
    """The longest run of consecutive surveyed releases, ending at the newest that has none
    missing, in which no ordinary run of the adapter misses a name."""
    releases = surface(engine)["releases"]
    ok = [not missing(engine, r) for r in releases]
    last = max(i for i, good in enumerate(ok) if good)
    first = last
    while first > 0 and ok[first - 1]:
        first -= 1
    return releases[first], releases[last]


def version_warning(engine: str, version: str) -> str | None:
    """One line when ``version`` of ``engine`` is outside the releases its adapter supports, naming
    what that release lacks where it was surveyed; None inside the range (or an engine without one)."""
    if engine not in SUPPORTED or not version:
        return None
    lo, hi = SUPPORTED[engine]
    key = version_key(version)
    if version_key(lo) <= key <= version_key(hi):
        return None
    name = ENGINE_NAMES[engine]
    where = f"{name} {version} is outside the versions mismatch-probe's {engine} adapter supports ({lo}–{hi})"
    surveyed = {version_key(r): r for r in surface(engine)["releases"]}
    if key not in surveyed:
        return f"{where}: its API was not surveyed (scripts/engine_api_surface.py); install {name} {lo}–{hi}"
    lacks = missing(engine, surveyed[key])
    names = ", ".join(sorted({u.name for u in lacks})) if lacks else "nothing it needs"
    return f"{where}: missing {names}"


# docs/concepts/engines.md, "Supported engine versions": the table between these markers is
# versions_table()'s (python scripts/engine_api_surface.py --docs writes it; a unit test checks it)
DOCS_BEGIN, DOCS_END = "<!-- engine-versions:begin -->", "<!-- engine-versions:end -->"


def versions_table(engine: str) -> str:
    """Per surveyed release: whether the adapter supports it, what an ordinary run misses there,
    and the features whose names the release lacks (each one's names)."""
    lo, hi = SUPPORTED[engine]
    rows = [
        f"| {ENGINE_NAMES[engine]} | supported | an ordinary run misses | features without their names |",
        "| --- | --- | --- | --- |",
    ]
    for release in surface(engine)["releases"]:
        inside = version_key(lo) <= version_key(release) <= version_key(hi)
        needed = ", ".join(f"`{n}`" for n in sorted({u.name for u in missing(engine, release)}))
        features: dict[str, set[str]] = {}
        for use in missing(engine, release, needed=False):
            if use.gated():
                features.setdefault(use.needed_for or "every run", set()).add(use.name)
        lacking = "; ".join(
            f"{feature}: " + ", ".join(f"`{n}`" for n in sorted(names)) for feature, names in sorted(features.items())
        )
        rows.append(f"| {release} | {'yes' if inside else 'no'} | {needed} | {lacking} |")
    return "\n".join(rows)


def versions_section() -> str:
    """The block of docs/concepts/engines.md between :data:`DOCS_BEGIN` and :data:`DOCS_END`."""
    parts = [DOCS_BEGIN, "<!-- generated by `python scripts/engine_api_surface.py --docs`; do not edit -->", ""]
    for engine, (lo, hi) in SUPPORTED.items():
        parts += [f"{ENGINE_NAMES[engine]}: {lo}–{hi}.", "", versions_table(engine), ""]
    return "\n".join([*parts, DOCS_END])
