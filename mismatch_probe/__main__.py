from mismatch_probe.cli import app

app()
