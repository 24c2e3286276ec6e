"""Rendering: a run's report.html, report.md and terminal summary, several runs side by side, a
sweep's pages, a timeline's pages. Each page is one view, built of the vocabulary of :mod:`.view`
from its record (:mod:`.run_view` with :mod:`.sync_view`, :mod:`.comparison_view`,
:mod:`.sweep_view`, :mod:`.timeline_view`) and rendered by :mod:`.html` (Jinja2 templates),
:mod:`.markdown` and :mod:`.terminal` (rich); the figures are matplotlib drawings written as SVG
(:mod:`.figures`); :mod:`.pages` writes a directory's report files. Reads a finished run (its
record and distributions, :mod:`.data`); computes nothing the analysis did not already persist,
except for old runs.
"""
