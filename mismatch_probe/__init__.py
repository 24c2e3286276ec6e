"""mismatch-probe: measure how far an inference engine and a training forward disagree.

``import mismatch_probe`` stays light: no engine library (vLLM, SGLang) and no torch is
imported until a run needs it.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
