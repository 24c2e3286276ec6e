"""A plain Markdown report of one run, rendered from its record alone (no numbers computed here).

It opens anywhere (a terminal, an editor, a CI artifact viewer, GitHub). Text that came from the
user (model paths, ids) is escaped for Markdown table cells.
"""

from __future__ import annotations

from mismatch_probe.analysis.metric_docs import METRIC_DOCS
from mismatch_probe.numbers import fmt
from mismatch_probe.record import Environment, Inputs, LogprobSemanticsRecord, RunRecord, SemanticsSide
from mismatch_probe.report.summary import architecture_rows, kv_cache_line, main_column, plain_notes, trainer_columns


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render_markdown(record: RunRecord) -> str:
    spec = record.spec
    env, inputs = record.environment or Environment(), record.inputs or Inputs()
    eng = record.engine.settings() if record.engine else {}
    kv_cache = record.engine.kv_cache_sizing if record.engine else None
    ref = record.reference.settings() if record.reference else {}
    later = bool(record.metric("n_model_tokens", "later"))
    semantics = record.logprob_semantics or LogprobSemanticsRecord()
    sem = semantics.engine
    ref_sem = semantics.reference or sem
    prefill = record.decode_vs_prefill or {}
    has_prefill = bool(prefill.get("n_model_tokens"))
    out = [
        f"# mismatch-probe run: {_cell(spec.name or (spec.engine.name if spec.engine else None))}",
        "",
        f"Status **{record.status}**, created {record.created_at}, mismatch-probe {record.probe_version}.",
        "",
        "## Setup",
        "",
        *_table(
            ["", "value"],
            [
                ["device", env.device_name],
                ["GPUs", ", ".join(g["name"] for g in env.gpus) or "none"],
                ["driver / CUDA", f"{env.nvidia_driver or '-'} / {env.cuda or '-'}"],
                ["libraries", ", ".join(f"{k} {v}" for k, v in env.packages.items())],
                ["model", inputs.model],
                *([k, v] for k, v in architecture_rows(record)),
                ["prompts", f"{inputs.prompts} ({inputs.n_prompts} prompts, {inputs.n_samples} samples)"],
                [
                    "engine",
                    ", ".join(
                        f"{k}={v}"
                        for k, v in eng.items()
                        if k not in ("versions", "requested", "routing_unavailable", "kv_cache_sizing")
                    ),
                ],
                *([["KV cache", kv_cache_line(kv_cache)]] if kv_cache else []),
                ["reference", ", ".join(f"{k}={v}" for k, v in ref.items() if k != "versions")],
                ["sampling", ", ".join(f"{k}={v}" for k, v in spec.sampling.to_dict().items())],
                ["engine log-probs", _distribution(sem) + f" ({sem.mode if sem else '-'})"],
                [
                    "reference log-probs",
                    _distribution(ref_sem)
                    + ("" if semantics.matched is not False else " (deliberately not the engine's)"),
                ],
            ],
        ),
        "",
        "## Headline metrics",
        "",
        (
            "`delta = logp_train - logp_infer`, `ratio = exp(delta)`, over model tokens only. "
            "The decode-vs-prefill column puts the engine's own full-sequence prefill log-prob in the "
            "reference's place: mismatch inside the engine, before any trainer is involved."
        ),
        "",
    ]
    extra = trainer_columns(record)
    header = (
        ["metric", main_column(record), "first turn"]
        + (["later turns"] if later else [])
        + (["decode vs prefill"] if has_prefill else [])
        + [label for label, _ in extra]
        + ["meaning"]
    )
    rows = []
    for doc in METRIC_DOCS:
        key, note = doc.key, doc.meaning + (f" ({doc.reference})" if doc.reference and doc.better else "")
        row = [f"`{key}`", fmt(record.metric(key)), fmt(record.metric(key, "first"))]
        if later:
            row.append(fmt(record.metric(key, "later")))
        if has_prefill:
            row.append(fmt(prefill.get(key)) if key != "log_ppl_train" else "-")
        row += [fmt(m.get(key)) for _, m in extra]
        rows.append(row + [note])
    out += _table(header, rows)
    remarks = plain_notes(record)
    if remarks:
        out += [""] + [f"- {line}" for line in remarks]

    corr = record.corrections or {}
    th = corr.get("thresholds") or {}
    out += [
        "",
        "## Correction what-ifs",
        "",
        "Share of the data each published correction would clip or drop at these thresholds.",
        "",
    ]
    out += _table(
        ["correction", "threshold", "share"],
        [
            [f"`{k}`", ", ".join(f"{a} {b:g}" for a, b in (th.get(k) or {}).items()), fmt(v)]
            for k, v in corr.items()
            if k != "thresholds"
        ],
    )

    bd = record.breakdowns or {}
    out += ["", "## |delta| by engine probability", "", "Mismatch concentrates on low-probability tokens.", ""]
    out += _table(
        ["p_infer", "tokens", "share", "mean abs delta", "p50", "p90", "p99", "max", "mean K3"],
        [
            [
                f"[{r['p_infer_lo']:g}, {r['p_infer_hi']:g}{']' if r['p_infer_hi'] == 1.0 else ')'}",
                r["count"],
                fmt(r["share"]),
                fmt(r.get("abs_delta_mean")),
                fmt(r.get("abs_delta_p50")),
                fmt(r.get("abs_delta_p90")),
                fmt(r.get("abs_delta_p99")),
                fmt(r.get("abs_delta_max")),
                fmt(r.get("k3_mean")),
            ]
            for r in bd.get("p_infer_buckets") or []
        ],
    )
    by_index = record.metrics_by_turn_index or {}
    if len(by_index) > 1:
        out += [
            "",
            "## By assistant turn",
            "",
            "Turn 0 answers the prompt; each later turn follows a tool response.",
            "",
        ]
        out += _table(
            [
                "turn",
                "model tokens",
                "sample-turns",
                "k3_kl",
                "mean prob diff",
                "max prob diff",
                "p99 abs delta",
                "log-ppl engine",
                "log-ppl reference",
            ],
            [
                [
                    t,
                    m.get("n_model_tokens"),
                    m.get("n_sequences"),
                    fmt(m.get("k3_kl")),
                    fmt(m.get("prob_diff_mean")),
                    fmt(m.get("prob_diff_max")),
                    fmt(m.get("abs_delta_p99")),
                    fmt(m.get("log_ppl_infer")),
                    fmt(m.get("log_ppl_train")),
                ]
                for t, m in by_index.items()
            ],
        )
    out += ["", "## By response length", ""]
    out += _table(
        ["model tokens", "sequences", "seq max mismatch (mean)", "share > 0.5", "seq mean mismatch"],
        [
            [
                f"[{r['length_lo']}, {r['length_hi'] or 'inf'})",
                r["count"],
                fmt(r["seq_max_mismatch_mean"]),
                fmt(r["seq_max_mismatch_gt_0_5_share"]),
                fmt(r["seq_mean_mismatch_mean"]),
            ]
            for r in bd.get("response_length_buckets") or []
        ],
    )
    out += ["", "## By token position", ""]
    out += _table(
        ["position", "tokens", "mean abs delta", "mean prob diff", "max prob diff", "mean K3"],
        [
            [
                f"[{r['position_lo']}, {r['position_hi'] or 'inf'})",
                r["count"],
                fmt(r["abs_delta_mean"]),
                fmt(r["prob_diff_mean"]),
                fmt(r["prob_diff_max"]),
                fmt(r["k3_mean"]),
            ]
            for r in bd.get("position_buckets") or []
        ],
    )
    routing = record.routing
    if routing and routing.get("n_tokens"):
        out += [
            "",
            "## MoE routing agreement",
            "",
            (
                f"Top-{routing['top_k']} expert sets chosen for each model token's input, engine vs reference "
                f"({routing.get('num_experts')} experts). A token flips when any layer picks another set; "
                f"{fmt(routing['tokens_with_flip_share'])} of tokens flipped."
            ),
            "",
        ]
        out += _table(
            ["MoE layer", "same expert set", "shared experts"],
            [
                [layer, fmt(a), fmt(o)]
                for layer, a, o in zip(
                    routing["moe_layers"], routing["set_agreement_by_layer"], routing["overlap_by_layer"]
                )
            ],
        )
        out += [""]
        out += _table(
            ["tokens", "count", "mean abs delta", "mean prob diff", "max prob diff", "mean K3"],
            [
                [
                    name,
                    routing[name]["n_tokens"],
                    fmt(routing[name]["abs_delta_mean"]),
                    fmt(routing[name]["prob_diff_mean"]),
                    fmt(routing[name]["prob_diff_max"]),
                    fmt(routing[name]["k3_mean"]),
                ]
                for name in ("flipped", "agreed")
            ],
        )
    figures = record.figures or []
    if figures:
        out += [
            "",
            "## Figures",
            "",
            ("The same figures, with captions and the worst sequences token by token, are in `report.html`."),
            "",
        ]
        out += [f"![{f.title}]({f.path})" for f in figures]
    out += ["", "## Timings", ""]
    out += _table(["stage", "seconds"], [[k.removesuffix("_s"), f"{v:.2f}"] for k, v in record.page_timings().items()])
    return "\n".join(out) + "\n"


def _distribution(side: SemanticsSide | None) -> str:
    return side.distribution if side else "-"
