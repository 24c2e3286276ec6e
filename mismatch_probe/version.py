"""The package's version, in a module of its own at the bottom of the layers: every layer records
it, and importing it pulls in nothing (the package root's lazy entry points included)."""

__version__ = "0.1.0"
