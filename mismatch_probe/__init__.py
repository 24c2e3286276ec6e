"""mismatch-probe: measure how far an inference engine and a training forward disagree.

``import mismatch_probe`` stays light: no engine library (vLLM, SGLang) and no torch is
imported until a run needs it.
"""

from mismatch_probe.version import __version__

__all__ = ["Monitor", "__version__", "import_dump", "load_run", "sweep"]


def __getattr__(name: str):
    # mismatch_probe.load_run without importing pyarrow/pydantic at ``import mismatch_probe``
    if name == "load_run":
        from mismatch_probe.api import load_run

        return load_run
    if name == "sweep":  # mismatch_probe.sweep(spec) -> SweepResult
        from mismatch_probe.sweeps import sweep

        return sweep
    if name == "import_dump":  # mismatch_probe.import_dump("slime", path, model=...) -> RunContext
        from mismatch_probe.importing import import_dump

        return import_dump
    # with mismatch_probe.Monitor(out_dir) as m: m.log_step(step, ids, logp_infer, logp_train, mask)
    if name == "Monitor":
        from mismatch_probe.timeline.monitor import Monitor

        return Monitor
    raise AttributeError(f"module 'mismatch_probe' has no attribute {name!r}")
