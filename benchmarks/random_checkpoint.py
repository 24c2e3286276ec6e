"""A checkpoint with a real model's shapes and random weights, for timings at a realistic size
(the fixtures are tiny: on a GPU their forward is launch overhead). The fixture's tokenizer goes
with it; the vocabulary of the model is the real one's, so the LM head costs what it costs.

    python benchmarks/random_checkpoint.py --out /tmp/qwen2.5-0.5b-shaped [--like qwen2.5-0.5b]
    python benchmarks/random_checkpoint.py --smoke   # the fixture's own shape, into a temporary directory

The shapes and the build are fixtures/shapes.py's (which also builds them with peaked distributions).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "fixtures"))
# the shapes (published config.json values) and the build live with the fixtures; fixtures/shapes.py
# also builds them with peaked next-token distributions
from shapes import FIXTURE, SHAPES, build

__all__ = ["SHAPES", "build", "fixture_shape"]


def fixture_shape() -> dict:
    """The committed fixture's own values of the shape's settings: the smallest checkpoint."""
    config = json.loads((FIXTURE / "config.json").read_text())
    return {k: config[k] for k in SHAPES["qwen2.5-0.5b"] if k != "model_type"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, help="where to write the checkpoint (required but with --smoke)")
    ap.add_argument("--like", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if not args.smoke:
        if args.out is None:
            ap.error("the following arguments are required: --out")
        print(build(args.out, args.like), file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = build(args.out or Path(tmp) / "model", args.like, shape=fixture_shape())
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out)  # what the benchmarks do with it
        print(f"{out}: {sum(p.numel() for p in model.parameters()):,} parameters, loads", file=sys.stderr)


if __name__ == "__main__":
    main()
