"""``mismatch-probe sweep``: the runs of a ``[sweep]`` (``runner``) and what they say together (``summary``).

import mismatch_probe
result = mismatch_probe.sweep("probes/sweep-demo.toml")
result.record.recommendation, result.record.point("engine.dtype=float32").delta_vs_baseline["k3_kl"]
"""

from mismatch_probe.sweeps.runner import SweepProgress, SweepResult, sweep

__all__ = ["SweepProgress", "SweepResult", "sweep"]
