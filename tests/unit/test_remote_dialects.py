"""The remote engine's dialects are one list (config/remote_dialects.py): every line imports to a
Dialect, engine.api's choices are that list, and the engine names no dialect in its code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mismatch_probe.config.remote_dialects import REMOTE_DIALECTS
from mismatch_probe.config.spec import ENGINE_DEFAULT_LOGPROBS_MODE, EngineSpec, spec_settings
from mismatch_probe.engines import get_entry
from mismatch_probe.engines.remote.dialect import Dialect, dialect_class

ENGINE = Path(__file__).resolve().parents[2] / "mismatch_probe" / "engines" / "remote" / "engine.py"


@pytest.mark.parametrize("api", list(REMOTE_DIALECTS))
def test_every_listed_dialect_is_a_dialect_and_is_described(api):
    cls = dialect_class(api)
    assert issubclass(cls, Dialect) and cls.generate_path and cls.sync_server
    entry = REMOTE_DIALECTS[api]
    assert f"{entry.server} (--engine-api {api})" in get_entry("remote").description
    assert ENGINE_DEFAULT_LOGPROBS_MODE.get(f"remote-{api}", "raw") == entry.logprobs_mode


def test_engine_api_takes_the_listed_dialects_and_no_other():
    assert spec_settings()["engine.api"].choices == tuple(REMOTE_DIALECTS)
    with pytest.raises(ValueError, match="openai"):
        EngineSpec(api="nope")


def test_the_engine_names_no_dialect():
    code = re.sub(r'""".*?"""', "", ENGINE.read_text(), flags=re.DOTALL)  # docstrings may
    named = [api for api in REMOTE_DIALECTS if re.search(rf"[\"']{api}[\"']", code)]
    assert named == [], f"engine.py branches on {named}: a dialect's own facts belong in its module"
