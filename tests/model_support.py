"""The supported-models table: what the model-family conformance suite (tests/families/) found,
committed as docs/model-support.json, rendered into docs/concepts/supported-models.md by scripts/supported_models.py.

Each conformance test runs one family on one column (the reference, its layouts, an engine) and
hands the outcome to :func:`check`: "ok" (it ran and every assertion held), "refused" (the
engine or the reference refused the family, with its own one-line reason) or "differs" (an
engine ran it, and its fp32 log-probs are not the model's: the reference, itself checked against a
float64 eager forward, disagrees). :func:`check` compares it with the committed table: a refusal
or a difference the table lists is an xfail carrying the reason
(so a fixed refusal shows up as a failure that asks for the table to be regenerated, never as a
silent skip); any other difference fails. With ``MISMATCH_PROBE_MODEL_SUPPORT_OUT`` set, every
outcome is also written to that file at the end of the session, and the committed table is not
consulted (scripts/supported_models.py runs the suite that way to regenerate it).

An outcome can depend on the CPU: the engines pick kernels by its instruction sets (vLLM's MLA
refuses float32 with AMX and runs another kernel without). So every cell keeps one outcome per CPU
kind it was measured on (``environment.cpu_kind``: "AMX", "AVX-512 BF16", ...), a run is compared
with its own kind's, and regenerating on one kind keeps the others'. A kind never measured is
held to the outcome every measured kind shares, and fails where they differ.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "model-support.json"
OUT_ENV = "MISMATCH_PROBE_MODEL_SUPPORT_OUT"
REGENERATE = "python scripts/supported_models.py"

# column -> header in the supported-models table, in table order
COLUMNS = {
    "reference": "reference fp32 (packed, padded)",
    "reference_tp2": "reference TP=2",
    "reference_sp2": "reference SP=2 (Ulysses)",
    "hf": "HF engine fp32",
    "vllm": "vLLM CPU",
    "sglang": "SGLang CPU",
}

OUTCOMES: dict[tuple[str, str], dict] = {}  # this session's, for OUT_ENV


def this_cpu_kind() -> str:
    from mismatch_probe.environment import cpu_isa, cpu_kind

    return cpu_kind(cpu_isa())


class Refused(Exception):
    """An engine or the reference refused to run a family; ``reason`` is its own message."""

    status = "refused"

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = normalize(reason)
        self.detail = detail  # measured numbers: in the message and the table's note, never compared


class Differs(Refused):
    """An engine ran a family and its log-probs are not the model's (``reason``: a fixed sentence)."""

    status = "differs"


def normalize(reason: str) -> str:
    """One stable line: the first line, without temporary paths, addresses or process ids."""
    line = reason.strip().splitlines()[0] if reason.strip() else "refused"
    line = re.sub(r"/\S*/tiny-([a-z0-9_]+)\S*", r"<tiny-\1>", line)
    line = re.sub(r"(/tmp|/var|/private)\S*", "<tmp>", line)
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"\bpid[ =]\d+", "pid …", line)
    return line[:300]


def committed() -> dict:
    return json.loads(TABLE.read_text()) if TABLE.is_file() else {"families": {}}


def on_kind(cell: dict, kind: str) -> dict | None:
    """A cell's outcome on CPU kind ``kind`` (a cell is ``{kind: outcome}``): its own, or for a kind
    never measured the one every measured kind shares; None where they differ or none was measured."""
    if kind in cell:
        return cell[kind]
    distinct = {(o["status"], o.get("reason")): o for o in cell.values()}
    return next(iter(distinct.values())) if len(distinct) == 1 else None


def expected(family: str, column: str, kind: str | None = None) -> dict | None:
    cell = committed()["families"].get(family, {}).get("results", {}).get(column)
    return None if cell is None else on_kind(cell, kind or this_cpu_kind())


def check(family: str, column: str, outcome: dict) -> None:
    """Record ``outcome`` ({"status": "ok"}, or "refused" / "differs" with a "reason") and compare
    it with the committed table."""
    detail = outcome.get("detail", "")
    OUTCOMES[(family, column)] = {k: v for k, v in outcome.items() if v != ""}
    where = f"{family} on {COLUMNS[column]}"
    said = f"{outcome['status']}: {outcome.get('reason', '')}" + (f" ({detail})" if detail else "")
    if os.environ.get(OUT_ENV):  # regenerating the table: what happened is the answer
        if outcome["status"] != "ok":
            pytest.xfail(f"{where} {said}")
        return
    kind = this_cpu_kind()
    where += f" ({kind} CPU)"
    want = expected(family, column, kind)
    if want is None:
        cell = committed()["families"].get(family, {}).get("results", {}).get(column)
        if cell:
            pytest.fail(
                f"{where} {said}; {TABLE.name} has it on {', '.join(cell)} CPUs only, where it differs: "
                f"regenerate it on this one: {REGENERATE}"
            )
        pytest.fail(f"{where}: not in {TABLE.name}; regenerate it: {REGENERATE}")
    if outcome["status"] == "ok":
        if want["status"] != "ok":
            pytest.fail(
                f"{where} now runs (the table says {want['status']}: {want['reason']}); regenerate it: {REGENERATE}"
            )
        return
    if want["status"] == "ok":
        pytest.fail(f"{where} {said}, and the table says it runs")
    if (want["status"], want.get("reason")) != (outcome["status"], outcome["reason"]):
        pytest.fail(f"{where} {said}; the table says {want['status']}: {want.get('reason')!r}")
    pytest.xfail(f"{where} {said}")


def run(family: str, column: str, probe) -> None:
    """Run ``probe()`` (assertions and all) and :func:`check` its outcome; a :class:`Refused` from
    the probe is the engine's refusal, anything else a failure of the test."""
    try:
        probe()
    except Refused as exc:  # or Differs
        check(family, column, {"status": exc.status, "reason": exc.reason, "detail": exc.detail})
    else:
        check(family, column, {"status": "ok"})


def write_outcomes() -> None:
    """This session's outcomes, with the CPU they were measured on."""
    from mismatch_probe.environment import cpu_model

    path = os.environ.get(OUT_ENV)
    if not path or not OUTCOMES:
        return
    out: dict = {}
    for (family, column), outcome in sorted(OUTCOMES.items()):
        out.setdefault(family, {})[column] = outcome
    run = {"cpu_kind": this_cpu_kind(), "cpu_model": cpu_model(), "outcomes": out}
    Path(path).write_text(json.dumps(run, indent=2) + "\n")
