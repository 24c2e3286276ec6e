"""An RL framework's own inputs read for ``mismatch-probe init``: its config (the engine and
sampling settings a probe spec repeats) and its dataset (``datasets.py``: the prompts file a probe
samples, drawn from the prompts the framework trains on)."""
