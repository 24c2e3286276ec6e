"""What every framework reader's tests check: the probe values key by key, where each came from,
what was not mirrored, the risks found, and that the spec `init` writes from it loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.frameworks import framework
from mismatch_probe.frameworks.base import StackReading, read_stack
from mismatch_probe.frameworks.init import init_spec
from mismatch_probe.frameworks.risks import find_risks

CONFIGS = Path(__file__).resolve().parent / "configs"


def read(name: str, *inputs: str | Path) -> StackReading:
    """Framework ``name``'s reading of ``inputs``: file names under tests/frameworks/configs/<name>/
    (or paths), and overrides as typed."""
    base = CONFIGS / name
    items = [str(base / i) if isinstance(i, str) and (base / i).is_file() else str(i) for i in inputs]
    return read_stack(framework(name), items)


def values(stack: StackReading) -> dict[str, Any]:
    return {k: v.value for k, v in stack.values.items()}


def from_user(stack: StackReading) -> set[str]:
    """The probe keys whose value came from the user's files or overrides (every origin of it)."""
    return {k for k, v in stack.values.items() if v.origins and all(o.from_user for o in v.origins)}


def unmirrored(stack: StackReading) -> dict[str, Any]:
    return {u.key: u.value for u in stack.unmirrored}


def risk_ids(stack: StackReading) -> set[str]:
    return {r.id for r in find_risks(stack)}


def check_values(stack: StackReading, expected: dict[str, Any]) -> None:
    """Every probe key the reading holds is expected, with exactly that value (and type: 1 is not True)."""
    got = values(stack)
    assert got == expected, {
        k: (got.get(k), expected.get(k)) for k in set(got) | set(expected) if got.get(k) != expected.get(k)
    }
    for k, v in expected.items():
        assert type(got[k]) is type(v), f"{k}: {type(got[k]).__name__} is not {type(v).__name__}"


def written_spec(name: str, tmp_path: Path, *inputs: str | Path, **kwargs: Any):
    """The spec `init` writes for ``inputs``, loaded back as `compare` loads it."""
    from mismatch_probe.config.spec_reading import load_spec_file

    base = CONFIGS / name
    items = [str(base / i) if isinstance(i, str) and (base / i).is_file() else str(i) for i in inputs]
    out = tmp_path / f"{name}.toml"
    init_spec(name, items, out=out, **kwargs)
    return load_spec_file(out), out.read_text()
