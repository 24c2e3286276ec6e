"""Configuration: the probe spec (``probe.toml``, ``[[variants]]``) and the gate's thresholds file.

The bottom layer with ``record``: it reads and validates what a user wrote and imports nothing of the
pipeline, so every other layer can take a validated spec. See ARCHITECTURE.md, "Layers".
"""
