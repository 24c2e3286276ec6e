"""Rendering: a run's report.html, report.md and terminal summary, several runs side by side, a
sweep's pages. One view model per page (:mod:`.model`, :mod:`.sweep`) is built from the record and
rendered by :mod:`.html` (Jinja2 templates), :mod:`.markdown` and :mod:`.terminal` (rich); the
figures are matplotlib drawings written as SVG (:mod:`.figures`). Reads a finished run (its record
and distributions, :mod:`.data`); computes nothing the analysis did not already persist, except
for old runs.
"""
