"""Your stack in one command: an RL framework's own config read into a probe spec (`mismatch-probe
init`), prompts sampled from its dataset, and the known mismatch risks of that configuration.

One module per framework, imported only when asked for (:func:`framework`); each declares its
defaults with their file:line at a named commit, its rules from its keys to the spec's settings, and
the keys the probe cannot mirror (``frameworks/base.py``). ``risks.py`` finds the risks,
``spec_file.py`` writes the spec, ``datasets.py`` samples the prompts.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from mismatch_probe.errors import ConfigError

# name -> module; the name is what `mismatch-probe init NAME` takes
FRAMEWORKS: dict[str, str] = {
    "verl": "mismatch_probe.frameworks.verl",
    "nemo-rl": "mismatch_probe.frameworks.nemo_rl",
    "openrlhf": "mismatch_probe.frameworks.openrlhf",
    "slime": "mismatch_probe.frameworks.slime",
    "trl": "mismatch_probe.frameworks.trl",
    "ms-swift": "mismatch_probe.frameworks.ms_swift",
    "prime-rl": "mismatch_probe.frameworks.prime_rl",
    "skyrl": "mismatch_probe.frameworks.skyrl",
}


def framework(name: str) -> ModuleType:
    """The module that reads framework ``name``'s config."""
    if name not in FRAMEWORKS:
        raise ConfigError(f"unknown framework {name!r}", hint=f"one of {', '.join(FRAMEWORKS)}")
    return importlib.import_module(FRAMEWORKS[name])
