"""Rendering: the self-contained HTML report and comparison pages (Jinja2 templates), report.md, the
matplotlib figures and the terminal summary. Reads a finished run (its record and distributions);
computes nothing that the analysis did not already persist, except for old runs.
"""
