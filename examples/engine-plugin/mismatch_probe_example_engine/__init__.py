"""The registration of the example engine: light to import (no torch), as mismatch-probe reads it
to list engines; the adapter itself is imported only in the engine's worker process."""

from mismatch_probe.engines import EngineEntry

ENTRY = EngineEntry(
    name="example-hf",
    target="mismatch_probe_example_engine.adapter:ExampleEngine",
    requires=("torch", "transformers"),
    install_hint="pip install ./examples/engine-plugin",
    description="example plugin: Hugging Face sampling, one full forward per token (no KV cache)",
    settings=frozenset({"device"}),  # besides the ones every engine honours (name, dtype, logprobs_mode, ...)
)
