"""A run as stages over one run directory, and the CLI's commands over them.

- :mod:`.runs`: run directories and their records (create, resume, derive, open), the context the
  stages share;
- :mod:`.stages`: prepare -> sample -> score -> analyze -> render;
- :mod:`.rollouts`: the sample stage's plumbing (shards through an engine, adopted rollouts);
- :mod:`.commands`: ``compare``, ``sample``, ``score``, ``analyze``, ``report``, each named as its
  command.

The library API is the commands and the types they return, re-exported here. See ARCHITECTURE.md,
"Stages".
"""

from mismatch_probe.pipeline.commands import (
    VariantsResult,
    analyze,
    compare,
    compare_variants,
    derive_run,
    report,
    sample,
    score,
)
from mismatch_probe.pipeline.runs import Progress, RunContext, RunResult, open_run, same_spec

__all__ = [
    "Progress",
    "RunContext",
    "RunResult",
    "VariantsResult",
    "analyze",
    "compare",
    "compare_variants",
    "derive_run",
    "open_run",
    "report",
    "same_spec",
    "sample",
    "score",
]
