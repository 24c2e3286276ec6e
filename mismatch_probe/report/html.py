"""The HTML reports: one run (``report.html`` in its directory) and several runs side by side.

Built from run directories alone (run.json and distributions.json; the per-token table only for
runs written before distributions.json existed), so it needs no engine and no GPU. This module
shapes the records into what the templates show; the templates (``templates/*.j2``, Jinja2 with
autoescape on) lay it out; :mod:`.figures` (SVG) and :mod:`.plots` (matplotlib, comparisons) draw the figures. No number is computed here.

The page is self-contained and inert: figures are embedded SVG (a run) or PNG (comparisons) data URIs, styles are inline,
there is no script at all, and a Content-Security-Policy forbids scripts and network loads
anyway, so a prompt or a model output that smuggled markup past escaping still could not run.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe import __version__
from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, METRIC_DOC, METRIC_DOCS, k3_context, rank
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import portable_path, resolve_from_dir, write_atomic
from mismatch_probe.numbers import fmt, pct
from mismatch_probe.record import EngineInfo, Environment, Inputs, ReferenceInfo, RunRecord, read_record
from mismatch_probe.report.summary import (
    architecture_rows,
    kv_cache_line,
    layout_label,
    plain_notes,
    short_dtype,
    trainer_columns,
    trainer_is_reference,
)

REPORT_HTML = "report.html"
# token colour classes by |p_train - p_infer|: upper bounds of g0 .. g4, g5 above
GAP_CLASSES = (1e-4, 1e-3, 1e-2, 0.1, 0.5)


@dataclass
class RunData:
    path: Path
    record: RunRecord
    dist: dict
    label: str = ""  # set for comparisons
    color: str = ""


def load_run(run_dir: str | Path) -> RunData:
    """A finished run's record and distributions: the token level from distributions.json, the
    sequence level from sequences.parquet (both computed from its token table if it predates them)."""
    from mismatch_probe.analysis import distributions
    from mismatch_probe.analysis.analyze import sequences_from_tokens
    from mismatch_probe.table.tokens import read_sequences

    run_dir = Path(run_dir)
    record = read_record(run_dir)
    assert record is not None  # read_record returns None only with missing_ok
    dist = distributions.load(run_dir)
    if dist is None:
        dist = compute_distributions(run_dir, record)
    elif "sequences" not in dist:  # the current format; version 1 stored the sequence level too
        sequences = read_sequences(run_dir)
        dist = distributions.with_sequences(
            dist, sequences if sequences is not None else sequences_from_tokens(run_dir)
        )
    return RunData(run_dir, record, dist)


def compute_distributions(run_dir: Path, record: RunRecord, tokenizer=None) -> dict:
    """Distributions from the per-token table, with the worst sequences' text when a tokenizer is
    given or the run's model directory is still where run.json says."""
    from mismatch_probe.analysis.analyze import analyze
    from mismatch_probe.analysis.distributions import DistributionAccumulator, with_sequences, worst_sequences
    from mismatch_probe.analysis.metrics import CorrectionThresholds
    from mismatch_probe.analysis.sequences import SequenceCollector

    thresholds = CorrectionThresholds(**record.spec.corrections)
    routing = record.engine.routing if record.engine else None
    acc, sequences = DistributionAccumulator(), SequenceCollector()
    analyze(run_dir, thresholds, routing.to_dict() if routing else None, acc, sequences)
    dist = acc.finish() if acc.result is None else acc.result
    if tokenizer is None:
        tokenizer = _tokenizer_if_present(record)
    dist["worst_sequences"] = worst_sequences(run_dir, dist["worst"], tokenizer)
    return with_sequences(dist, sequences.table)


def _tokenizer_if_present(record: RunRecord):
    model = record.inputs.model if record.inputs else None
    if not model or not Path(model, "config.json").is_file():
        return None
    try:
        from mismatch_probe.modeling.loading import load_tokenizer

        return load_tokenizer(Path(model), trust_remote_code=bool(record.spec.trust_remote_code))
    except Exception:  # token ids are shown instead of text
        return None


# ---- labels ---------------------------------------------------------------------------------


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
    return f"CPU: {env.cpu_model or env.device_name or 'unknown'}"


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
        return f"your trainer ({(record.imported_from or {}).get('format', 'dump')}, from the dump)"
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


# ---- formatting -----------------------------------------------------------------------------


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _gap_class(gap: float) -> str:
    for k, bound in enumerate(GAP_CLASSES):
        if gap < bound:
            return f"g{k}"
    return f"g{len(GAP_CLASSES)}"


def token_view(seq: dict) -> list[dict]:
    """The shown tokens of one worst sequence as spans: text, CSS class, hover title; a gap entry
    where tokens were left out."""
    t = seq["tokens"]
    texts = t.get("text")
    spans, previous = [], None
    seen_model = False
    for k, pos in enumerate(t["position"]):
        if previous is not None and pos > previous + 1:
            spans.append({"gap": pos - previous - 1})
        previous = pos
        tid = t["token_id"][k]
        text = texts[k] if texts is not None else f"⟨{tid}⟩"
        if t["is_model"][k]:
            seen_model = True
            p_i, p_t = t["p_infer"][k], t["p_train"][k]
            gap = abs(p_t - p_i)
            delta = math.log(p_t) - math.log(p_i) if p_t > 0 else -math.inf
            cls = _gap_class(gap) + (" wt" if pos == seq["worst_position"] else "")
            title = (
                f"p_infer {p_i:.4g} · p_train {p_t:.4g} · |Δp| {gap:.3g} · δ {delta:+.3g} · "
                f"token {tid} · position {pos} · turn {t['turn'][k]}"
            )
        else:
            cls = "tool" if seen_model else "prompt"
            title = f"{'tool output' if seen_model else 'prompt'} token {tid} · position {pos} (not scored)"
        spans.append({"text": text if text != "" else "∅", "cls": cls, "title": title})
    n_last = seq["n_tokens"] - 1
    if previous is not None and previous < n_last:
        spans.append({"gap": n_last - previous})
    return spans


# ---- one run --------------------------------------------------------------------------------


def _environment_rows(record: RunRecord) -> list[tuple[str, str]]:
    env, inputs = record.environment or Environment(), record.inputs or Inputs()
    eng = record.engine.settings() if record.engine else {}
    ref = record.reference.settings() if record.reference else {}
    kv_cache = record.engine.kv_cache_sizing if record.engine else None
    skip_engine = {
        "engine",
        "requested",
        "versions",
        "routing",
        "routing_unavailable",
        "env",
        "per_request_seeds_off_because",
        "kv_cache_sizing",
    }
    versions = {**env.packages, **(record.engine.versions if record.engine else {})}
    probe = env.mismatch_probe
    rows = [
        ("hardware", gpu_type(record)),
        ("GPUs", ", ".join(f"{g.get('name')} ({g.get('memory_gib', '?')} GiB)" for g in env.gpus) or "none"),
        ("CPU", f"{env.cpu_model or '-'} ({env.cpu_count or '?'} cores, {env.memory_gib or '?'} GiB)"),
        ("driver / CUDA", f"{env.nvidia_driver or '-'} / {env.cuda or '-'}"),
        ("libraries", ", ".join(f"{k} {v}" for k, v in versions.items())),
        ("python / platform", f"{env.python or '-'} / {env.platform or '-'}"),
        (
            "mismatch-probe",
            f"{probe.get('version') or record.probe_version} ({probe.get('git_commit') or 'no git'})",
        ),
        ("model", inputs.model or "-"),
        *architecture_rows(record),
        ("prompts", f"{inputs.prompts} ({inputs.n_prompts} prompts, {inputs.n_samples} samples)"),
        ("engine", engine_label(record)),
        ("engine settings", ", ".join(f"{k}={v}" for k, v in eng.items() if k not in skip_engine)),
        *([("KV cache", kv_cache_line(kv_cache))] if kv_cache else []),
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


def _metric_rows(record: RunRecord) -> tuple[list[str], list[dict]]:
    by_turn = record.metrics_by_turn or {}
    prefill = record.decode_vs_prefill or {}
    columns = [("all", record.metrics or {})]
    if record.metric("n_model_tokens", "later"):
        columns += [("first turn", by_turn.get("first") or {}), ("later turns", by_turn["later"])]
    if prefill.get("n_model_tokens"):
        columns.append(("decode vs prefill", prefill))
    columns += trainer_columns(record)
    rows = []
    for doc in METRIC_DOCS:
        values = []
        for name, m in columns:
            if name == "decode vs prefill" and doc.key == "log_ppl_train":
                values.append("-")
            else:
                values.append(fmt(m.get(doc.key)))
        rows.append(
            {"key": doc.key, "label": doc.label, "values": values, "meaning": doc.meaning, "reference": doc.reference}
        )
    return [name for name, _ in columns], rows


def _headline(record: RunRecord) -> list[dict]:
    m = record.metric
    cards = [
        {"label": "K3 KL (mismatch-KL)", "value": fmt(m("k3_kl")), "note": k3_context(m("k3_kl"))},
        {
            "label": "max token |Δp|",
            "value": fmt(m("prob_diff_max")),
            "note": f"mean {fmt(m('prob_diff_mean'))}; per-sequence max averages {fmt(m('seq_max_mismatch_mean'))}",
        },
        {
            "label": "sequences with max |Δp| > 0.5",
            "value": pct(m("seq_max_mismatch_gt_0_5_share")),
            "note": f"{fmt(m('seq_max_mismatch_gt_0_5_count'))} of {fmt(m('n_sequences'))} sequences",
        },
        {
            "label": "token mult. prob error",
            "value": fmt(m("mult_prob_error")),
            "note": _mult_note(m("mult_prob_error")),
        },
    ]
    prefill = record.decode_vs_prefill or {}
    if prefill.get("n_model_tokens"):
        cards.append(
            {
                "label": "decode vs prefill K3",
                "value": fmt(prefill.get("k3_kl")),
                "note": "inside the engine: its sampled log-probs against its own full-sequence prefill",
            }
        )
    first_k3, later_k3 = m("k3_kl", "first"), m("k3_kl", "later")
    if m("n_model_tokens", "later") and first_k3 and later_k3 is not None:
        cards.append(
            {
                "label": "later / first turn K3",
                "value": _ratio(later_k3, first_k3),
                "note": f"first {fmt(first_k3)}, later {fmt(later_k3)}",
            }
        )
    return cards


def _ratio(a, b) -> str:
    try:
        return f"{float(a) / float(b):.3g}×"
    except (TypeError, ValueError, ZeroDivisionError):
        return "-"


def _mult_note(v) -> str:
    if v is None:
        return ""
    if isinstance(v, str) or v > 1.05:
        return "above NeMo-RL's 1.05 threshold"
    return "below NeMo-RL's 1.05 threshold (1.0 is perfect)"


def _correction_rows(record: RunRecord) -> list[dict]:
    corr = record.corrections or {}
    by_turn = record.corrections_by_turn or {}
    has_later = bool(record.metric("n_model_tokens", "later"))
    th = corr.get("thresholds") or {}
    rows = []
    for key, (name, what) in CORRECTION_DOCS.items():
        row: dict[str, Any] = {
            "name": name,
            "key": key,
            "what": what,
            "threshold": ", ".join(f"{a.replace('_', ' ')} {b:g}" for a, b in (th.get(key) or {}).items()),
            "values": [pct(corr.get(key))],
        }
        if has_later:
            row["values"] += [pct((by_turn.get("first") or {}).get(key)), pct((by_turn.get("later") or {}).get(key))]
        rows.append(row)
    return rows


@functools.cache
def _templates():
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(
        loader=PackageLoader("mismatch_probe.report", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fmt"] = fmt
    env.filters["pct"] = pct
    return env


def render_run(run: RunData, figures: list[dict] | None = None) -> str:
    """The one-run report as an HTML string (figures drawn here unless given)."""
    from mismatch_probe.report.figures import run_figures

    record, dist = run.record, run.dist
    if figures is None:
        figures = run_figures(record, dist)
    columns, metric_rows = _metric_rows(record)
    corrections = _correction_rows(record)
    bd = record.breakdowns or {}
    routing = record.routing
    by_turn_index = record.metrics_by_turn_index or {}
    context = {
        "title": f"mismatch-probe: {run_label(record, run.path)}",
        "run_name": run_label(record, run.path),
        "subtitle": f"{engine_label(record)}  vs  {reference_label(record)}  on  {gpu_type(record)}",
        "record": record,
        "status": record.status,
        "headline": _headline(record),
        "notes": plain_notes(record),
        "environment": _environment_rows(record),
        "metric_columns": columns,
        "metric_rows": metric_rows,
        "figures": [{**f, "src": _data_uri(f["svg"], "image/svg+xml")} for f in figures],
        "corrections": corrections,
        "correction_columns": ["all"] + (["first turn", "later turns"] if len(corrections[0]["values"]) > 1 else []),
        "p_buckets": bd.get("p_infer_buckets") or [],
        "by_turn_index": by_turn_index if len(by_turn_index) > 1 else {},
        "routing": routing if routing and routing.get("n_tokens") else None,
        "routing_layers": list(
            zip(routing["moe_layers"], routing["set_agreement_by_layer"], routing["overlap_by_layer"])
        )
        if routing and routing.get("n_tokens")
        else [],
        "worst": [{**seq, "spans": token_view(seq)} for seq in dist.get("worst_sequences") or []],
        "worst_has_text": any((s["tokens"].get("text") is not None) for s in dist.get("worst_sequences") or []),
        "timings": record.page_timings(),
        "samples": record.samples or {},
        "tokenization_check": record.tokenization_check,
        "gap_classes": [("g0", f"< {GAP_CLASSES[0]:g}")]
        + [(f"g{k + 1}", f"{GAP_CLASSES[k]:g} – {GAP_CLASSES[k + 1]:g}") for k in range(len(GAP_CLASSES) - 1)]
        + [(f"g{len(GAP_CLASSES)}", f"≥ {GAP_CLASSES[-1]:g}")],
        "version": __version__,
        "generated_at": _now(),
    }
    return _templates().get_template("run.html.j2").render(**context)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


# ---- several runs ---------------------------------------------------------------------------

COMPARISON_EXTRA_ROWS = (  # (section, key, label, better)
    ("metrics_by_turn.later", "k3_kl", "K3 KL, later turns", "lower"),
    ("decode_vs_prefill", "k3_kl", "K3 KL, decode vs prefill", "lower"),
)


def _settings(record: RunRecord) -> dict[str, str]:
    """Flat settings of a run, for the table of what differs between runs."""
    flat: dict[str, Any] = {"hardware": gpu_type(record)}
    env, inputs = record.environment or Environment(), record.inputs or Inputs()
    flat["model"] = inputs.model
    flat["prompts"] = f"{inputs.prompts} ({inputs.n_prompts} × {record.spec.sampling.n})"
    flat["driver / CUDA"] = f"{env.nvidia_driver or '-'} / {env.cuda or '-'}"
    for k, v in {**env.packages, **(record.engine.versions if record.engine else {})}.items():
        flat[k] = v
    # kv_cache_sizing holds the free memory at start-up, which differs between any two runs
    skip = {
        "requested",
        "versions",
        "routing",
        "routing_unavailable",
        "per_request_seeds_off_because",
        "kv_cache_sizing",
    }
    for k, v in (record.engine.settings() if record.engine else {}).items():
        if k not in skip:
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


def render_comparison(runs: list[RunData]) -> str:
    """Several runs side by side, grouped by hardware type: settings that differ, every headline
    metric with the best and the worst run marked, and overlaid distributions."""
    from mismatch_probe.report.plots import RUN_COLORS, comparison_figures

    names = [run_label(r.record, r.path) for r in runs]
    for k, run in enumerate(runs):
        # runs of one probe spec share its name; their directories tell them apart
        run.label = names[k] if names.count(names[k]) == 1 else run.path.name
        run.color = RUN_COLORS[k % len(RUN_COLORS)]
    labels = [r.label for r in runs]
    for k, run in enumerate(runs):
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({k + 1})"
    # group by hardware type (in the order types first appear), then by configuration
    order = list(dict.fromkeys(gpu_type(r.record) for r in runs))
    runs = sorted(
        runs, key=lambda r: (order.index(gpu_type(r.record)), engine_label(r.record), reference_label(r.record))
    )
    groups = [{"name": g, "runs": [r for r in runs if gpu_type(r.record) == g]} for g in order]

    settings = [_settings(r.record) for r in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    differing = [
        {"key": k, "values": [s.get(k, "-") for s in settings]}
        for k in keys
        if len({s.get(k, "-") for s in settings}) > 1
    ]

    metric_rows = []
    for doc in METRIC_DOCS:
        values = [r.record.metric(doc.key) for r in runs]
        best, worst = rank(values, doc.better)
        metric_rows.append(
            {
                "label": doc.label,
                "key": doc.key,
                "meaning": doc.meaning,
                "cells": [{"text": fmt(v), "best": i in best, "worst": i in worst} for i, v in enumerate(values)],
            }
        )
    for section, key, label, better in COMPARISON_EXTRA_ROWS:
        values = [r.record.lookup(f"{section}.{key}") for r in runs]
        if all(v is None for v in values):
            continue
        best, worst = rank(values, better)
        metric_rows.append(
            {
                "label": label,
                "key": f"{section}.{key}",
                "meaning": METRIC_DOC[key].meaning,
                "cells": [{"text": fmt(v), "best": i in best, "worst": i in worst} for i, v in enumerate(values)],
            }
        )
    correction_rows = []
    for key, (name, what) in CORRECTION_DOCS.items():
        values = [(r.record.corrections or {}).get(key) for r in runs]
        best, worst = rank(values, "lower")
        correction_rows.append(
            {
                "label": name,
                "key": key,
                "meaning": what,
                "cells": [{"text": pct(v), "best": i in best, "worst": i in worst} for i, v in enumerate(values)],
            }
        )

    warnings = []
    for what in ("model", "prompts"):
        if len({s.get(what) for s in settings}) > 1:
            warnings.append(f"The runs use different {what}; their numbers measure different things.")
    thresholds = {json.dumps((r.record.corrections or {}).get("thresholds"), sort_keys=True) for r in runs}
    if len(thresholds) > 1:
        warnings.append("The runs use different correction thresholds; their what-if shares are not comparable.")

    sources = {resolve_from_dir(r.path, (r.record.rollouts_from or {}).get("run") or ".") for r in runs}
    figure_runs = [{"label": r.label, "color": r.color, "record": r.record, "dist": r.dist} for r in runs]
    context = {
        "title": f"mismatch-probe: {len(runs)} runs compared",
        "runs": [
            {
                "label": r.label,
                "color": r.color,
                "path": portable_path(r.path),
                "hardware": gpu_type(r.record),
                "engine": engine_label(r.record),
                "reference": reference_label(r.record),
                "tokens": r.record.metric("n_model_tokens"),
                "sequences": r.record.metric("n_sequences"),
                "created_at": r.record.created_at,
                "notes": plain_notes(r.record),
            }
            for r in runs
        ],
        "groups": [{"name": g["name"], "span": len(g["runs"])} for g in groups],
        "differing": differing,
        "metric_rows": metric_rows,
        "correction_rows": correction_rows,
        "warnings": warnings,
        "shared_rollouts": portable_path(next(iter(sources))) if len(sources) == 1 else None,
        "figures": [{**f, "src": _data_uri(f["png"])} for f in comparison_figures(figure_runs)],
        "version": __version__,
        "generated_at": _now(),
    }
    return _templates().get_template("compare.html.j2").render(**context)


@dataclass
class WrittenReport:
    path: Path
    n_bytes: int
    seconds: float
    n_runs: int


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> WrittenReport:
    """Render the report of one run (default ``<run>/report.html``) or the comparison of several
    (default ``compare.html``) and write it atomically."""
    if not run_dirs:
        raise ConfigError("no run directories given", hint="mismatch-probe report RUN_DIR [RUN_DIR ...]")
    t0 = time.perf_counter()
    runs = [load_run(d) for d in run_dirs]
    html = render_run(runs[0]) if len(runs) == 1 else render_comparison(runs)
    target = Path(out) if out else (runs[0].path / REPORT_HTML if len(runs) == 1 else Path("compare.html"))
    if target.is_dir():
        raise ConfigError(f"--out {target} is a directory", hint="give a file name, e.g. --out compare.html")
    write_atomic(target, html)
    return WrittenReport(target, len(html.encode("utf-8")), time.perf_counter() - t0, len(runs))
