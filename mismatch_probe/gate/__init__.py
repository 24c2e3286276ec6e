"""The CI gate: checks a finished run's metrics (and statistics over its sequences) against a
thresholds file, and writes the result as JSON or a JUnit XML file for CI systems.
"""
