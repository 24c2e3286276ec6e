"""Terminal rendering of a run record (the CLI's end-of-run summary). Rendering only: no numbers
are computed here, they all come from the run's :class:`~mismatch_probe.record.RunRecord`."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rich.table import Table

from mismatch_probe.analysis.metric_docs import negative_chi2_note
from mismatch_probe.numbers import fmt
from mismatch_probe.record import ReferenceInfo, RunRecord

SUMMARY_ROWS = (
    ("k3_kl", "K3 KL (mean, 'vllm-kl')"),
    ("k1_kl", "K1 KL (mean -delta)"),
    ("abs_delta_mean", "mean |delta|"),
    ("abs_delta_p99", "p99 |delta|"),
    ("prob_diff_mean", "mean |p_train - p_infer|"),
    ("prob_diff_max", "max |p_train - p_infer|"),
    ("seq_max_mismatch_mean", "seq max mismatch (mean)"),
    ("seq_max_mismatch_gt_0_5_share", "share of seqs with max mismatch > 0.5"),
    ("mult_prob_error", "token mult. prob error"),
    ("chi2_token", "chi2 (token)"),
    ("chi2_token_sn", "chi2 (token, self-normalized)"),
    ("chi2_seq", "chi2 (sequence)"),
    ("chi2_seq_sn", "chi2 (sequence, self-normalized)"),
    ("ess", "ESS (token ratios, normalized)"),
    ("pearson_prob", "Pearson r of token probs"),
    ("log_ppl_infer", "log-ppl (engine)"),
    ("log_ppl_train", "log-ppl (reference)"),
    ("n_zero_prob_train", "tokens the reference gives p = 0"),
    ("n_model_tokens", "model tokens"),
    ("n_sequences", "sequences"),
)


def trainer_is_reference(record: RunRecord) -> bool:
    """An imported dump's run whose reference column is the dump's own trainer log-probs."""
    return record.reference is not None and record.reference.to_dict().get("source") == "trainer"


def main_column(record: RunRecord) -> str:
    """What the metrics' first column compares."""
    if trainer_is_reference(record):
        return f"engine vs your trainer ({(record.imported_from or {}).get('format', 'dump')})"
    return "engine vs reference"


# an imported dump re-scored by the reference (record.trainer): its trainer's log-probs against both
TRAINER_COLUMNS = (
    ("engine_vs_trainer", "engine vs your trainer"),
    ("trainer_vs_reference", "your trainer vs reference"),
)


def trainer_columns(record: RunRecord) -> list[tuple[str, dict]]:
    """(label, metrics) of the ``trainer`` section's comparisons, when the run has one."""
    section = record.trainer or {}
    return [(label, section[key]) for key, label in TRAINER_COLUMNS if section.get(key)]


def metrics_table(record: RunRecord) -> Table:
    has_later = bool(record.metric("n_model_tokens", "later"))
    prefill = record.decode_vs_prefill or {}
    has_prefill = bool(prefill.get("n_model_tokens"))
    extra = trainer_columns(record)
    table = Table(title=f"mismatch: {_title(record)}", title_justify="left")
    table.add_column("metric")
    table.add_column(main_column(record), justify="right")
    table.add_column("first turn", justify="right")
    if has_later:
        table.add_column("later turns", justify="right")
    if has_prefill:
        table.add_column("engine decode vs its prefill", justify="right")
    for label, _ in extra:
        table.add_column(label, justify="right")
    for key, label in SUMMARY_ROWS:
        row = [label, fmt(record.metric(key)), fmt(record.metric(key, "first"))]
        if has_later:
            row.append(fmt(record.metric(key, "later")))
        if has_prefill:
            row.append(fmt(prefill.get(key)) if key not in ("log_ppl_train",) else "-")
        row += [fmt(m.get(key)) for _, m in extra]
        table.add_row(*row)
    return table


def notes(record: RunRecord) -> list[str]:
    """Things the numbers alone do not say: semantics, skipped checks, zero-probability tokens."""
    out = []
    sem = record.logprob_semantics
    if sem is not None and sem.matched is False and sem.reference is not None and sem.engine is not None:
        if trainer_is_reference(record):  # the run's own two sides: the difference is part of what it trained on
            out.append(
                f"[yellow]note:[/] the trainer's log-probs are of {sem.reference.distribution} but the engine's are "
                f"of {sem.engine.distribution}: the mismatch above includes that difference, as the run's did"
            )
        else:
            out.append(
                f"[yellow]note:[/] the reference scores {sem.reference.distribution} but the engine's log-probs "
                f"are {sem.engine.distribution} (reference.logprobs = {record.spec.reference.logprobs!r}); "
                "the mismatch above includes that difference on purpose"
            )
    return out + _other_notes(record)


def _other_notes(record: RunRecord) -> list[str]:
    out: list[str] = []
    n_zero = record.metric("n_zero_prob_train")
    if n_zero:
        out.append(
            f"[yellow]note:[/] {n_zero} sampled token(s) have probability 0 under the reference "
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
    if record.prefill_skipped:
        out.append(f"decode vs prefill: not measured, {record.prefill_skipped}")
    out += import_notes(record)
    if chi2 := negative_chi2_note({"metrics": record.metrics, "metrics_by_turn": record.metrics_by_turn}):
        out.append(f"note: {chi2}")
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
        out.append(
            f"[yellow]note:[/] assumed, not read from the dump: {', '.join(defaults)} (flags of `import` set them)"
        )
    out += [f"[yellow]note:[/] {line}" for line in imported.get("notes") or []]
    return out


def plain_notes(record: RunRecord) -> list[str]:
    """:func:`notes` without rich markup, for the Markdown and HTML reports."""
    return [re.sub(r"\[/?[a-z ]*\]", "", line) for line in notes(record)]


TIMING_LABELS = (
    ("setup_s", "setup"),
    ("engine_start_s", "engine start"),
    ("generation_s", "generation"),
    ("prefill_s", "engine prefill"),
    ("engine_stop_s", "engine stop"),
    ("reference_load_s", "reference load"),
    ("scoring_s", "reference scoring"),
    ("metrics_s", "metrics"),
    ("figures_s", "figures"),
    ("report_s", "report"),
)


def timing_line(record: RunRecord) -> str | None:
    t = record.timings
    total = t.get("total_s")
    if not total:
        return None
    parts = [f"{label} {t[key]:.1f}s ({t[key] / total:.0%})" for key, label in TIMING_LABELS if key in t]
    return f"time {total:.1f}s: " + ", ".join(parts)


def corrections_table(record: RunRecord) -> Table:
    corr = record.corrections or {}
    thresholds = corr.get("thresholds") or {}
    table = Table(title="correction what-ifs (share of data a trainer would clip or drop)", title_justify="left")
    table.add_column("correction")
    table.add_column("threshold")
    table.add_column("share", justify="right")
    for key, value in corr.items():
        if key == "thresholds":
            continue
        bounds = ", ".join(f"{k} {v:g}" for k, v in (thresholds.get(key) or {}).items())
        table.add_row(key, bounds, fmt(value))
    return table


def routing_line(record: RunRecord) -> str | None:
    r = record.routing
    if not r or not r.get("n_tokens"):
        return None
    flipped, agreed = r["flipped"], r["agreed"]
    line = (
        f"MoE routing: {fmt(r['tokens_with_flip_share'])} of tokens changed experts in at least one layer "
        f"(expert-set agreement by layer: {', '.join(fmt(a) for a in r['set_agreement_by_layer'])})"
    )
    if flipped["n_tokens"] and agreed["n_tokens"]:
        line += (
            f"; mean |delta| {fmt(flipped['abs_delta_mean'])} on those tokens vs "
            f"{fmt(agreed['abs_delta_mean'])} elsewhere"
        )
    return line


def _title(record: RunRecord) -> str:
    spec_engine, eng, ref, env = record.spec.engine, record.engine, record.reference, record.environment
    if record.imported_from:
        against = "its trainer" if trainer_is_reference(record) else f"reference {ref.dtype if ref else None}"
        return f"{eng.engine if eng else None} from a {record.imported_from.get('format')} dump vs {against}"
    return (
        f"{spec_engine.name if spec_engine else None} {eng.dtype if eng else None} "
        f"vs reference {ref.dtype if ref else None}"
        f"{' (fp32 logits)' if ref and ref.logits_fp32 else ''} on {env.device_name if env else None}"
    )


def kv_cache_line(sizing: Mapping[str, Any]) -> str:
    """The KV cache mismatch-probe chose for the engine (``engine.kv_cache_sizing``), and from what."""
    line = f"{sizing.get('kv_cache_memory_bytes', 0) / 2**20:,.0f} MiB"
    if sizing.get("bytes_per_token") and sizing.get("tokens"):
        line += f" ({sizing['tokens']:,} tokens of {sizing['bytes_per_token']:,} bytes)"
    return f"{line}, chosen by mismatch-probe: {sizing.get('rule', '')}"


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


VARIANT_COLUMNS = (
    ("k3_kl", "K3 KL"),
    ("abs_delta_p99", "p99 |delta|"),
    ("prob_diff_max", "max |dp|"),
    ("seq_max_mismatch_mean", "seq max mismatch"),
    ("seq_max_mismatch_gt_0_5_share", "seqs > 0.5"),
    ("mult_prob_error", "mult. error"),
    ("n_model_tokens", "tokens"),
)


def variants_table(records: Mapping[str, RunRecord]) -> Table:
    """One row per variant of a spec (its name and record): the same rollouts, each variant's
    reference."""
    table = Table(title="variants: the same rollouts, scored by each reference", title_justify="left")
    table.add_column("variant")
    table.add_column("reference")
    for _, label in VARIANT_COLUMNS:
        table.add_column(label, justify="right")
    for name, record in records.items():
        ref = record.reference
        head = "+fp32 head" if ref and ref.logits_fp32 else ""
        label = f"{short_dtype(ref.dtype if ref else None)}{head} {layout_label(ref)}".strip()
        table.add_row(name, label, *(fmt(record.metric(key)) for key, _ in VARIANT_COLUMNS))
    return table


def architecture_rows(record: RunRecord) -> list[tuple[str, str]]:
    """The environment card's rows for the checkpoint's architecture and its quirks (what the
    model does beyond a plain decoder, and how the reference runs it)."""
    arch = record.architecture
    if not arch:
        return []
    heads = f"{arch.get('attention_heads')} query / {arch.get('kv_heads')} key-value heads"
    line = f"{arch.get('architecture') or arch.get('model_type')}: {arch.get('layers')} layers, {heads}"
    quirks = arch.get("quirks") or []
    return [("architecture", line), ("model quirks", "; ".join(quirks) if quirks else "none")]
