"""A checkpoint with a real model's shapes and random weights, for timings at a realistic size
(the fixtures are tiny: on a GPU their forward is launch overhead). The fixture's tokenizer goes
with it; the vocabulary of the model is the real one's, so the LM head costs what it costs.

    python benchmarks/random_checkpoint.py --out /tmp/qwen2.5-0.5b-shaped [--like qwen2.5-0.5b]
    python benchmarks/random_checkpoint.py --smoke   # the fixture's own shape, into a temporary directory
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "models" / "tiny-qwen2"

# config.json values of the published checkpoints (Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen2.5-1.5B-Instruct)
SHAPES = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


def build(out: Path, like: str = "qwen2.5-0.5b", seed: int = 0, shape: dict | None = None) -> Path:
    """A checkpoint of ``like``'s shape (``shape`` replaces any of its values) with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fixture = AutoConfig.from_pretrained(FIXTURE)  # the special tokens are the fixture tokenizer's
    tokens = {k: getattr(fixture, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    shape = {**SHAPES[like], **(shape or {})}
    config = AutoConfig.for_model(fixture.model_type, **shape, max_position_embeddings=32768, **tokens)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in FIXTURE.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")) or f.name == "vocab.json":
            shutil.copyfile(f, out / f.name)
    info = {"like": like, "weights": "random", "seed": seed, **({"shape": shape} if shape != SHAPES[like] else {})}
    (out / "build_info.json").write_text(json.dumps(info) + "\n")
    return out


def fixture_shape() -> dict:
    """The committed fixture's own values of the shape's settings: the smallest checkpoint."""
    config = json.loads((FIXTURE / "config.json").read_text())
    return {k: config[k] for k in SHAPES["qwen2.5-0.5b"]}


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
