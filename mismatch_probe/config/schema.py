"""JSON Schemas of the probe spec and the thresholds file, generated from their models.

The shipped files (``probe-spec.schema.json``, ``thresholds.schema.json`` next to this module) let
an editor check a TOML file as it is typed (taplo / Even Better TOML: a ``#:schema`` line at the top
of the file, or a ``.taplo.toml`` rule). Regenerate them after changing a model::

    python -m mismatch_probe.config.schema            # writes both files
    python -m mismatch_probe.config.schema --check    # exit 1 if a shipped file is out of date

A unit test compares the shipped files with :func:`schemas`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.config.thresholds import ThresholdsFile

HERE = Path(__file__).resolve().parent
DRAFT = "https://json-schema.org/draft/2020-12/schema"
MODELS: dict[str, tuple[type[BaseModel], str]] = {
    "probe-spec.schema.json": (ProbeSpec, "mismatch-probe probe spec (probes/*.toml)"),
    "thresholds.schema.json": (ThresholdsFile, "mismatch-probe gate thresholds ([[checks]] tables)"),
}


def schemas() -> dict[str, dict[str, Any]]:
    """File name -> the JSON Schema of its model."""
    out = {}
    for name, (model, title) in MODELS.items():
        out[name] = {"$schema": DRAFT, **model.model_json_schema(), "title": title}
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    stale = []
    for name, schema in schemas().items():
        path = HERE / name
        text = render(schema)
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    for name in stale:
        print(f"{HERE / name} is out of date: run python -m mismatch_probe.config.schema", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
