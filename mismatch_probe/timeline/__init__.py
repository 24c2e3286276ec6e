"""The mismatch of an RL run over its training steps (ARCHITECTURE.md, Timeline).

``store`` is the timeline directory's step files; ``dump_steps`` reads one step of a framework's
dump as the model tokens :func:`~mismatch_probe.analysis.timeline.step_rows` reduces; ``runner``
imports every step of a run (in parallel processes, resumable, incremental, following a live run),
tests each metric for drift, keeps the steps worth opening as full run directories and renders the
page; ``monitor`` is the same directory written from inside a training loop.
"""
