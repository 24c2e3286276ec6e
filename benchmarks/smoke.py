"""The ``--smoke`` flag every script of benchmarks/ offers: a size that runs in seconds, through the
same code as the full size, which tests/benchmarks/test_smoke.py runs in CI so that no benchmark
rots unexercised. Each script sets its own smoke sizes; this module words the flag once."""

from __future__ import annotations

import argparse

HELP = "a size that runs in seconds: what CI runs to keep this script working"


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help=HELP)
