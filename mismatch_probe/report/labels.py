"""Words about a run: what its engine, reference and hardware are called, what its metric
columns compare, and the notes the numbers alone do not say; and what a timeline's metrics are
called. Used by the views (:mod:`.run_view`, :mod:`.comparison_view`, :mod:`.sync_view`,
:mod:`.timeline_view`) and the timeline's figures; nothing here computes a number."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, METRIC_DOC, negative_chi2_note
from mismatch_probe.numbers import fmt, mib, pct
from mismatch_probe.record import EngineInfo, Environment, Inputs, ReferenceInfo, RunRecord, SyncInfo

# an imported dump re-scored by the reference (record.trainer): its trainer's log-probs against both
TRAINER_COLUMNS = (
    ("engine_vs_trainer", "engine vs your trainer"),
    ("trainer_vs_reference", "your trainer vs reference"),
)
FIRST_TURN, LATER_TURNS, DECODE_VS_PREFILL = "first turn", "later turns", "decode vs prefill"


def trainer_is_reference(record: RunRecord) -> bool:
    """An imported dump's run whose reference column is the dump's own trainer log-probs."""
    return record.reference is not None and record.reference.to_dict().get("source") == "trainer"


def main_column(record: RunRecord) -> str:
    """What the metrics' first column compares."""
    if trainer_is_reference(record):
        return f"engine vs your trainer ({record.import_info().format or 'dump'})"
    return "engine vs reference"


def has_later_turns(record: RunRecord) -> bool:
    """Whether the run has model tokens after a tool turn; without them its first turn is all of it."""
    return bool(record.metric("n_model_tokens", "later"))


def metric_columns(record: RunRecord) -> list[tuple[str, Mapping[str, Any]]]:
    """The metric table's columns, (label, metrics), by the one rule every renderer shows: all
    tokens (:func:`main_column`); the first and later turns when the run has later turns; decode vs
    prefill when it was measured; an imported dump's trainer comparisons when it has them."""
    by_turn = record.metrics_by_turn or {}
    prefill = record.decode_vs_prefill or {}
    columns: list[tuple[str, Mapping[str, Any]]] = [(main_column(record), record.metrics or {})]
    if has_later_turns(record):
        columns += [(FIRST_TURN, by_turn.get("first") or {}), (LATER_TURNS, by_turn.get("later") or {})]
    if prefill.get("n_model_tokens"):
        columns.append((DECODE_VS_PREFILL, prefill))
    section = record.trainer or {}
    columns += [(label, section[key]) for key, label in TRAINER_COLUMNS if section.get(key)]
    return columns


def not_measured(column: str, key: str) -> bool:
    """A cell with no meaning: the engine's prefill has no reference log-ppl."""
    return column == DECODE_VS_PREFILL and key == "log_ppl_train"


# ---- the run's parts ---------------------------------------------------------------------------


def short_dtype(dtype: str | None) -> str:
    if not dtype:
        return ""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def layout_label(reference: ReferenceInfo | None) -> str:
    """The reference's parallel layout, e.g. "SP2 TP2"; empty for one process."""
    if reference is None:
        return ""
    sizes = (("SP", reference.sequence_parallel_size), ("TP", reference.tensor_parallel_size))
    return " ".join(f"{tag}{size}" for tag, size in sizes if (size or 1) > 1)


def gpu_type(record: RunRecord) -> str:
    if record.imported_from:  # the engine ran in the training job, on hardware the dump does not name
        where = f"{record.imported_from.get('format')} dump"
        return where if trainer_is_reference(record) else f"{where}, reference on {_machine(record)}"
    return _machine(record)


def _machine(record: RunRecord) -> str:
    env = record.environment or Environment()
    names = list(dict.fromkeys(g.get("name") for g in env.gpus if g.get("name")))
    eng, ref = record.engine or EngineInfo(), record.reference or ReferenceInfo()
    devices = {str(eng.platform or eng.device or ""), str(ref.device or "")}
    if names and devices != {"cpu"}:  # a GPU machine where both sides ran on the CPU is a CPU run
        return " + ".join(names)
    # the CPU's kind is part of the hardware type: its instruction sets pick the engines' kernels
    kind = f" ({env.cpu_kind})" if env.cpu_kind else ""
    return f"CPU: {env.cpu_model or env.device_name or 'unknown'}{kind}"


def engine_label(record: RunRecord) -> str:
    eng, spec = record.engine or EngineInfo(), record.spec.engine
    if record.imported_from:  # the settings it ran with are the training job's, not known here
        return f"{eng.engine or '?'} (from a {record.imported_from.get('format')} dump)"
    parts = [
        eng.engine or (spec.name if spec else None) or "?",
        short_dtype(eng.dtype or (spec.dtype if spec else None)),
    ]
    if eng.tensor_parallel_size:
        parts.append(f"TP{eng.tensor_parallel_size}")
    # the multi-GPU / multi-node layout, by mismatch-probe's name (vLLM) or SGLang's own
    settings = eng.settings()
    for short, names in (("PP", ("pipeline_parallel_size", "pp_size")), ("DP", ("data_parallel_size", "dp_size"))):
        size = next((settings[n] for n in names if isinstance(settings.get(n), int)), 1)
        if size > 1:
            parts.append(f"{short}{size}")
    if isinstance(settings.get("nnodes"), int) and settings["nnodes"] > 1:
        parts.append(f"{settings['nnodes']} nodes")
    if eng.enforce_eager is True:
        parts.append("eager")
    elif eng.enforce_eager is False:
        parts.append("compiled")
    if eng.kv_cache_dtype not in (None, "auto"):
        parts.append(f"kv {eng.kv_cache_dtype}")
    if eng.quantization:
        parts.append(str(eng.quantization))
    if eng.batch_invariant:
        parts.append("batch-invariant")
    if eng.cascade_attn:
        parts.append("cascade-attn")
    return " ".join(p for p in parts if p)


def reference_label(record: RunRecord) -> str:
    if trainer_is_reference(record):
        return f"your trainer ({record.import_info().format or 'dump'}, from the dump)"
    ref = record.reference or ReferenceInfo()
    dtype = ref.dtype or record.spec.reference.dtype
    parts = ["HF", short_dtype(dtype)]
    if ref.logits_fp32 and dtype != "float32":
        parts.append("+fp32 head")
    if ref.attn_implementation:
        parts.append(ref.attn_implementation)
    if ref.packing:
        parts.append(ref.packing)
    parts.append(layout_label(ref))
    return " ".join(p for p in parts if p)


def run_label(record: RunRecord, path: Path) -> str:
    return record.spec.name or path.name


def given_run_dir(record: RunRecord, path: Path) -> Path:
    """The run's directory as the run was given it (its ``out``, from where it was made), for the
    commands a page prints: the same page wherever the directory is copied."""
    return Path(record.spec.out) if record.spec.out else path


def kv_cache_line(sizing: Mapping[str, Any]) -> str:
    """The KV cache mismatch-probe chose for the engine (``engine.kv_cache_sizing``), and from what."""
    line = mib(sizing.get("kv_cache_memory_bytes", 0))
    if sizing.get("bytes_per_token") and sizing.get("tokens"):
        line += f" ({fmt(sizing['tokens'])} tokens of {fmt(sizing['bytes_per_token'])} bytes)"
    return f"{line}, chosen by mismatch-probe: {sizing.get('rule', '')}"


def quantization_rows(record: RunRecord) -> list[tuple[str, str]]:
    """What the engine loaded instead of the model (engine.checkpoint) and the quantization it
    declares, then what the engine reports each group of layers runs (``quantization_layers``)."""
    rows = []
    inputs = record.inputs or Inputs()
    if inputs.engine_checkpoint:
        declared = inputs.engine_checkpoint_quantization or {}
        declared_groups = "; ".join(
            f"{', '.join(g.get('targets') or [])}: weights {g.get('weights')}, activations {g.get('activations')}"
            for g in (declared.get("groups") or {}).values()
        )
        parts = [declared.get("method"), declared.get("format"), declared_groups]
        if declared.get("not_quantized"):
            parts.append(f"not quantized: {', '.join(declared['not_quantized'])}")
        line = " · ".join(str(p) for p in parts if p) or "no quantization declared"
        rows.append(("engine checkpoint", f"{inputs.engine_checkpoint} ({line})"))
    layers = record.engine.settings().get("quantization_layers") if record.engine else None
    if layers:
        ran = []
        for g in layers.get("groups", []):
            kernel = f" via {g['kernel']}" if g.get("kernel") else ""
            params = ", ".join(f"{p} {d}" for p, d in g.get("params", {}).items())
            weight = g.get("weight") or {}
            if weight:  # the quantized weight as the kernel keeps it, and the path it chose by the CPU
                path = ", ".join(f"{k}={v}" for k, v in (weight.get("path") or {}).items())
                params = f"{weight['format']} weights in {weight.get('held_in')}" + (f", {path}" if path else "")
            ran.append(f"{g.get('scheme') or g.get('method')}{kernel}: {g.get('n_layers')} layers ({params})")
        rows.append(("quantization (engine)", f"{layers.get('quant_config')}; " + "; ".join(ran)))
    return rows


def rollout_precision(record: RunRecord) -> str:
    """The rollout's number format, as the published figures are grouped (``metric_docs.PUBLISHED_K3``):
    the weights' format of a quantized engine checkpoint or of the engine's own quantization (fp8,
    int8, int4), else an fp8 KV cache, else the engine's dtype (fp16, bf16, fp32)."""
    declared = (record.inputs or Inputs()).engine_checkpoint_quantization or {}
    for group in (declared.get("groups") or {}).values():
        weights = str(group.get("weights") or "")
        for kind in ("fp8", "int8", "int4"):
            if weights.startswith(kind):
                return kind
    engine = record.lookup("spec.engine") or {}
    method = str(engine.get("quantization") or declared.get("method") or "").lower()
    if "fp8" in method:
        return "fp8"
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        return "int4"
    if str(engine.get("kv_cache_dtype") or "").startswith("fp8"):
        return "fp8 KV cache"
    dtype = str(engine.get("dtype") or "")
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype or "bf16")


def architecture_rows(record: RunRecord) -> list[tuple[str, str]]:
    """The setup's rows for the checkpoint's architecture and its quirks (what the model does
    beyond a plain decoder, and how the reference runs it)."""
    arch = record.architecture
    if not arch:
        return []
    heads = f"{arch.get('attention_heads')} query / {arch.get('kv_heads')} key-value heads"
    line = f"{arch.get('architecture') or arch.get('model_type')}: {arch.get('layers')} layers, {heads}"
    # records written before the run said it themselves claim the routing in the MoE quirk, whatever ran
    quirks = [q.removesuffix(LEGACY_ROUTING_CLAIM) for q in arch.get("quirks") or []]
    rows = [("architecture", line), ("model quirks", "; ".join(quirks) if quirks else "none")]
    if arch.get("moe"):
        rows.append(("MoE routing", routing_status(record)))
    return rows


LEGACY_ROUTING_CLAIM = "; routing recorded on both sides"


def routing_status(record: RunRecord) -> str:
    """Whether this run compared an MoE model's routing, engine against reference, as its record says."""
    routing = record.routing or {}
    if routing.get("n_tokens"):
        return f"compared on {routing['n_tokens']:,} model tokens, engine against reference"
    asked = (record.spec.engine.to_dict() if record.spec.engine else {}).get("record_routing", True)
    if not asked:
        return "not compared: engine.record_routing = false"
    why = record.engine.to_dict().get("routing_unavailable") if record.engine else None
    return f"not compared: {why or 'the engine did not return its routing'}"


# engine settings that are not how it ran: what was asked, versions (a row of their own), routing
# data, and kv_cache_sizing, which holds the free memory at start-up (it differs between any two runs)
ENGINE_BOOKKEEPING = {
    "requested",
    "versions",
    "routing",
    "routing_unavailable",
    "per_request_seeds_off_because",
    "version_warning",  # a row of its own (setup_rows)
    "kv_cache_sizing",
    "quantization_layers",  # a row of its own (quantization_rows)
    "workarounds",  # a row of its own (workaround_rows)
    "kernels",  # a row of its own (cpu_kernel_rows)
}


def workaround_rows(record: RunRecord) -> list[tuple[str, str]]:
    """A row for the engine bugs the adapter worked around in this run (``engine.workarounds``),
    each with how often it applied (a counted one that never applied is left out; one that holds
    for the whole run, such as how a buffer is allocated, has no count); none when none applied."""
    done = (record.engine.settings().get("workarounds") if record.engine else None) or {}
    parts = [
        w["what"] if "restored" not in w else f"{w['what']}: {w['restored']} entries"
        for w in done.values()
        if isinstance(w, dict) and w.get("what") and ("restored" not in w or w["restored"])
    ]
    return [("engine workarounds", "; ".join(parts))] if parts else []


def cpu_kernel_rows(record: RunRecord) -> list[tuple[str, str]]:
    """The CPU's kernel-selecting instruction sets (runs recorded before them have none) and the
    kernels the engine says it chose on them."""
    env = record.environment or Environment()
    rows = []
    if env.cpu_kind:
        aten = f"; ATen dispatch {env.aten_cpu_capability}" if env.aten_cpu_capability else ""
        rows.append(("CPU kernels", f"{env.cpu_kind}: {', '.join(env.cpu_isa) or 'none of the kernel ISAs'}{aten}"))
    kernels = record.engine.to_dict().get("kernels") if record.engine else None
    if kernels:

        def show(value: Any) -> str:  # {kernel: layers running it}, or one fact
            if isinstance(value, dict):
                return ", ".join(f"{kernel} x{n}" for kernel, n in value.items())
            return {True: "yes", False: "no"}.get(value, str(value)) if isinstance(value, bool) else str(value)

        rows.append(("engine kernels", "; ".join(f"{k}: {show(v)}" for k, v in kernels.items())))
    return rows


def setup_rows(record: RunRecord) -> list[tuple[str, str]]:
    """The environment and settings of a run, as (name, value) rows."""
    env, inputs = record.environment or Environment(), record.inputs or Inputs()
    eng = record.engine.settings() if record.engine else {}
    ref = record.reference.settings() if record.reference else {}
    kv_cache = record.engine.kv_cache_sizing if record.engine else None
    versions = {**env.packages, **(record.engine.versions if record.engine else {})}
    probe = env.mismatch_probe
    rows = [
        ("hardware", gpu_type(record)),
        (
            "GPUs",
            ", ".join(
                f"{g.get('name')} ({g.get('memory_gib', '?')} GiB, compute capability {g.get('compute_capability', '?')})"
                for g in env.gpus
            )
            or "none",
        ),
        ("CPU", f"{env.cpu_model or '-'} ({env.cpu_count or '?'} cores, {env.memory_gib or '?'} GiB)"),
        *cpu_kernel_rows(record),
        ("driver / CUDA", f"{env.nvidia_driver or '-'} / {env.cuda or '-'}"),
        ("libraries", ", ".join(f"{k} {v}" for k, v in versions.items())),
        ("python / platform", f"{env.python or '-'} / {env.platform or '-'}"),
        ("mismatch-probe", f"{probe.get('version') or record.probe_version} ({probe.get('git_commit') or 'no git'})"),
        ("model", inputs.model or "-"),
        *architecture_rows(record),
        ("prompts", f"{inputs.prompts} ({inputs.n_prompts} prompts, {inputs.n_samples} samples)"),
        ("engine", engine_label(record)),
        *([("engine version", eng["version_warning"])] if eng.get("version_warning") else []),
        (
            "engine settings",
            ", ".join(f"{k}={v}" for k, v in eng.items() if k not in ENGINE_BOOKKEEPING | {"engine", "env"}),
        ),
        *([("KV cache", kv_cache_line(kv_cache))] if kv_cache else []),
        *quantization_rows(record),
        *workaround_rows(record),
        ("reference", reference_label(record)),
        ("reference settings", ", ".join(f"{k}={v}" for k, v in ref.items() if k != "versions")),
        ("sampling", ", ".join(f"{k}={v}" for k, v in record.spec.sampling.to_dict().items())),
    ]
    semantics = record.logprob_semantics
    if semantics is not None and semantics.to_dict():
        sem = semantics.engine
        ref_sem = semantics.reference or sem
        rows.append(
            (
                "log-prob semantics",
                f"engine: {sem.distribution if sem else '-'} ({sem.mode if sem else '-'}); reference: "
                f"{ref_sem.distribution if ref_sem else '-'}"
                + ("" if semantics.matched is not False else " — deliberately not the engine's"),
            )
        )
    return rows


def comparable_settings(record: RunRecord) -> dict[str, str]:
    """Flat settings of a run, for the table of what differs between runs."""
    flat: dict[str, Any] = {"hardware": gpu_type(record)}
    env, inputs = record.environment or Environment(), record.inputs or Inputs()
    flat["model"] = inputs.model
    flat["prompts"] = f"{inputs.prompts} ({inputs.n_prompts} × {record.spec.sampling.n})"
    flat["driver / CUDA"] = f"{env.nvidia_driver or '-'} / {env.cuda or '-'}"
    for k, v in {**env.packages, **(record.engine.versions if record.engine else {})}.items():
        flat[k] = v
    for k, v in (record.engine.settings() if record.engine else {}).items():
        if k not in ENGINE_BOOKKEEPING:
            flat[f"engine.{k}"] = v
    for k, v in (record.reference.settings() if record.reference else {}).items():
        if k != "versions":
            flat[f"reference.{k}"] = v
    for k, v in record.spec.sampling.to_dict().items():
        flat[f"sampling.{k}"] = v
    sem = record.logprob_semantics
    flat["reference log-probs"] = sem.reference.distribution if sem and sem.reference else None
    return {
        k: (json.dumps(v) if isinstance(v, (dict, list)) else ("-" if v is None else str(v)))
        for k, v in _dotted(flat).items()
    }


def _dotted(d: dict, prefix: str = "") -> dict:
    """Nested settings (e.g. the reference's parallel layout) as one row per leaf."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---- the weight-sync probe (record.sync) --------------------------------------------------------

SYNC_CLEAN = "the synced engine matches a fresh load bit for bit"
# the start checkpoint the probe makes itself (config/choices.py: PERTURBED)
SYNC_START = {"perturbed": "perturbed (the model with small deterministic noise, made by the probe)"}
# the sync's timings (sync.timings), in the order shown; sync_s holds one duration per sync
SYNC_TIMING_LABELS = {
    "fresh_engine_start_s": "fresh engine start (for the comparison)",
    "engine_start_s": "synced engine start (from the start checkpoint)",
}


def sync_findings(sync: Mapping[str, Any]) -> list[str]:
    """Each finding of a weight sync, as its message."""
    return [str(f.get("message") or f.get("kind")) for f in sync.get("findings") or []]


def sync_verdict(sync: Mapping[str, Any]) -> tuple[bool, str]:
    """(clean, the headline): clean when no finding and every sync's prefill log-probs equal a fresh
    engine's bit for bit; else how many findings (their messages: :func:`sync_findings`), or which
    sync was not shown to match."""
    findings = sync.get("findings") or []
    if findings:
        return False, f"{len(findings)} finding{'s' if len(findings) > 1 else ''} in the weight sync"
    if sync.get("complete") is False:  # the sample stage's measurements, before the analysis compared them
        return False, "not analyzed yet: the syncs were measured but not compared with a fresh engine"
    repeats = sync.get("repeats") or []
    if not repeats:
        return False, "no sync was measured"
    shares = [
        (k + 1 if r.repeat is None else r.repeat, r.fidelity.get("bitwise_share"))
        for k, r in enumerate(SyncInfo.model_validate(sync).repeats)
    ]
    off = [(k, share) for k, share in shares if share != 1]
    if not off:
        return True, SYNC_CLEAN
    return False, "no finding, but not shown to match a fresh load bit for bit: " + "; ".join(
        f"sync {k}: " + ("log-probs not compared" if share is None else f"{pct(share)} of tokens bitwise equal")
        for k, share in off
    )


def sync_setup_rows(sync: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the sync probe did: the engine, where it started from, the sync's settings, and MoE
    routing after the sync where the engine reports it."""
    settings = dict(sync.get("settings") or {})
    start = settings.pop("start_from", None)
    rows = [
        ("engine", str(sync.get("engine") or "-")),
        ("started from", SYNC_START.get(str(start), str(start)) if start is not None else "-"),
        ("sync settings", ", ".join(f"{k}={v}" for k, v in settings.items()) or "-"),
    ]
    if sync.get("fault_injected"):
        rows.append(("fault injected (a test's)", str(sync["fault_injected"])))
    fid = sync.get("fidelity")
    if isinstance(fid, Mapping) and fid:  # the last sync's prefill of the run's own rollouts
        line = (
            f"{pct(fid.get('bitwise_share'))} of {fmt(fid.get('tokens'))} model tokens bitwise equal, "
            f"max |Δ log p| {fmt(fid.get('max_abs_dlogp'))}, K3 {fmt(fid.get('k3'))}"
        )
        rows.append(("the rollouts, synced vs fresh prefill", line))
    routing = sync.get("routing")
    if isinstance(routing, Mapping) and routing:
        if "unavailable" in routing:
            line = f"not measured: {routing['unavailable']}"
        else:
            line = ", ".join(f"{k} {fmt(v)}" for k, v in routing.items() if not isinstance(v, (Mapping, list)))
        rows.append(("MoE routing after the sync", line or "-"))
    return rows


def sync_engine_report(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A sync's report as the engine gave it (``repeats[k].report``): the update call, what the
    engine loaded and did not, the prefix-cache reset, the dtype sent; a fault injected by a test."""
    engine = dict(report.get("engine_report") or {})
    rows = [("update call", str(report.get("call") or "-"))]
    if "loaded" in engine:
        rows.append(("loaded", fmt(engine.pop("loaded"))))
    if "not_loaded" in engine:
        missing = engine.pop("not_loaded") or []
        rows.append(("not loaded", ", ".join(map(str, missing)) if missing else "none"))
    rows += [(str(k).replace("_", " "), _plain(v)) for k, v in engine.items()]
    reset = report.get("reset_prefix_cache")
    if isinstance(reset, Mapping):
        rows.append(("prefix cache reset", f"{reset.get('call', '-')}: {_plain(reset.get('result'))}"))
    elif reset is not None:
        rows.append(("prefix cache reset", _plain(reset)))
    if report.get("dtype_sent") is not None:
        rows.append(("dtype sent", str(report["dtype_sent"])))
    if report.get("fault"):
        rows.append(("fault injected (a test's)", str(report["fault"])))
    return rows


def _plain(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (Mapping, list)) else fmt(value)


# ---- what the numbers alone do not say ---------------------------------------------------------

NOTE = "note: "  # a note that warns (the terminal colours it)


def notes(record: RunRecord) -> list[str]:
    """Things the numbers alone do not say: semantics, skipped checks, zero-probability tokens, an
    imported dump's provenance. Plain text; the warnings start with :data:`NOTE`."""
    out = []
    sem = record.logprob_semantics
    if sem is not None and sem.matched is False and sem.reference is not None and sem.engine is not None:
        if trainer_is_reference(record):  # the run's own two sides: the difference is part of what it trained on
            out.append(
                f"{NOTE}the trainer's log-probs are of {sem.reference.distribution} but the engine's are "
                f"of {sem.engine.distribution}: the mismatch above includes that difference, as the run's did"
            )
        else:
            out.append(
                f"{NOTE}the reference scores {sem.reference.distribution} but the engine's log-probs "
                f"are {sem.engine.distribution} (reference.logprobs = {record.spec.reference.logprobs!r}); "
                "the mismatch above includes that difference on purpose"
            )
    n_zero = record.metric("n_zero_prob_train")
    if n_zero:
        out.append(
            f"{NOTE}{n_zero} sampled token(s) have probability 0 under the reference "
            "(e.g. just outside its top-p/top-k set): their delta is -inf, so K3 and mean |delta| are inf; "
            "the quantiles and prob-diff columns still describe the rest"
        )
    check = record.tokenization_check or {}
    if check.get("n_checked"):
        out.append(
            f"tokenization check: {check['n_differing']} of {check['n_checked']} conversations get other token ids "
            "when their chat is re-rendered and re-tokenized"
            + (" (a trainer that re-tokenizes would score different tokens)" if check["n_differing"] else "")
        )
    if (server := record.server_template_check) and server.get("n_differing"):
        out.append(
            f"{NOTE}the rollout server renders the chat itself, and {server_template_summary(server)}: the probe "
            "scores the ids the server sampled from, but a trainer that renders the prompt with the checkpoint's "
            "chat template trains on other tokens than the server saw"
        )
    if record.prefill_skipped:
        out.append(f"decode vs prefill: not measured, {record.prefill_skipped}")
    out += import_notes(record)
    if chi2 := negative_chi2_note({"metrics": record.metrics, "metrics_by_turn": record.metrics_by_turn}):
        out.append(f"{NOTE}{chi2}")
    return out


def import_notes(record: RunRecord) -> list[str]:
    """What an imported dump's run compares, and what its reader found in the dump."""
    imported = record.imported_from
    if not imported:
        return []
    step = f" step {imported['step']}" if imported.get("step") is not None else ""
    what = f"imported from a {imported.get('format')} dump{step} ({imported.get('path')})"
    if trainer_is_reference(record):
        what += ": the reference column is the trainer's own log-probs from the dump (what the run saw)"
    elif record.trainer:
        what += ": the trainer columns put the dump's trainer log-probs beside this reference"
    defaults = [k for k, source in (imported.get("settings_from") or {}).items() if source == "default"]
    out = [what]
    if defaults:
        out.append(f"{NOTE}assumed, not read from the dump: {', '.join(defaults)} (flags of `import` set them)")
    out += [f"{NOTE}{line}" for line in imported.get("notes") or []]
    return out


def server_template_summary(check: dict) -> str:
    """A rollout server's prompt ids against the checkpoint's chat template (``server_template_check``)."""
    text = (
        f"{check.get('n_differing', 0)} of {check.get('n_turns', 0)} contexts "
        f"({pct(check.get('share_differing'))}) differ from the checkpoint's chat template"
    )
    if check.get("n_cut"):
        text += f"; {check['n_cut']} conversations ended before a later turn whose context differed"
    if first := (check.get("examples") or [None])[0]:
        text += (
            f"; first difference at token {first['first_difference_at']} (sample {first['sample_id']}, "
            f"turn {first['turn']}): ours {first.get('ours_text', first['ours'])!r}, "
            f"the server's {first.get('server_text', first['server'])!r}"
        )
    return text


# ---- a timeline's metrics (analysis/timeline.py: step_rows) ------------------------------------

ROUTING_LABELS = {"routing_flip_share": "routing flip share", "routing_set_agreement_mean": "routing set agreement"}
SHARES = (*CORRECTION_DOCS, "routing_flip_share")  # shown as percentages


def metric_label(key: str) -> str:
    """A metric's name on the page: its documented label, a correction's name, or routing's."""
    if key in METRIC_DOC:
        return METRIC_DOC[key].label
    if key in CORRECTION_DOCS:
        return f"{CORRECTION_DOCS[key].label} share"
    return ROUTING_LABELS.get(key, key)
