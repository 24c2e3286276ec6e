"""Reference scoring throughput on the fixture: padding-free packing (per-sequence "varlen" SDPA, the
default, and transformers' dense block-mask SDPA) vs padded micro-batches vs a naive loop (one
sequence per forward through the model's own forward, full-vocab logits).

    python benchmarks/bench_reference.py [--sequences 256] [--dtype float32] [--repeats 3]

Sequences are fixture prompts followed by random "responses" of mixed lengths (16-400 tokens),
the length spread RL batches have. Prints tokens/s per mode and the ratios, all from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.modeling.loading import load_tokenizer
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.rollout.prompts import tokenize_prompts
from mismatch_probe.table.tokens import Rollout

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
PROMPTS = ROOT / "fixtures" / "prompts" / "single_turn.jsonl"


def make_rollouts(n: int, seed: int = 0) -> list[Rollout]:
    tok = load_tokenizer(MODEL)
    prompts = tokenize_prompts(PROMPTS, tok, max_model_len=1024, max_new_tokens=400)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)].token_ids
        resp = rng.integers(3, len(tok), int(rng.integers(16, 400))).astype(np.int32)
        ids = np.concatenate([p, resp])
        model = np.r_[np.zeros(len(p), bool), np.ones(len(resp), bool)]
        out.append(
            Rollout(
                i, str(i), ids, np.where(model, 0, -1).astype(np.int16), model, np.zeros(len(ids), np.float32), "length"
            )
        )
    return out


def naive(model, rollouts):
    for r in rollouts:
        with torch.inference_mode():
            logits = model(input_ids=torch.from_numpy(r.token_ids.astype(np.int64))[None]).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            pos = torch.from_numpy(np.flatnonzero(r.is_model_token))
            lp[pos - 1, torch.from_numpy(r.token_ids[r.is_model_token].astype(np.int64))].numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    rollouts = make_rollouts(args.sequences)
    n_tokens = sum(len(r.token_ids) for r in rollouts)
    n_scored = sum(int(r.is_model_token.sum()) for r in rollouts)
    sem = LogprobSemantics("raw")
    modes = {
        "packed, varlen sdpa (default)": ReferenceScorer(
            MODEL, ReferenceSpec(dtype=args.dtype, packing=True, micro_batch_size=64, max_tokens_per_micro_batch=4096)
        ),
        "padded (16 seq/mb)": ReferenceScorer(
            MODEL, ReferenceSpec(dtype=args.dtype, packing=False, micro_batch_size=16)
        ),
    }
    # transformers' own packed path: sdpa with a dense block-diagonal [T x T] mask per micro-batch
    dense = ReferenceScorer(
        MODEL, ReferenceSpec(dtype=args.dtype, packing=True, micro_batch_size=64, max_tokens_per_micro_batch=4096)
    )
    dense.model.set_attn_implementation("sdpa")
    dense.varlen = False
    modes["packed, dense block mask (hf sdpa)"] = dense
    naive_model = modes["padded (16 seq/mb)"].model
    runs = {k: (lambda s=s: s.score(rollouts, sem)) for k, s in modes.items()}
    runs["naive (1 seq/forward)"] = lambda: naive(naive_model, rollouts)
    for fn in runs.values():  # warm-up
        fn()
    times = {k: [] for k in runs}
    for _ in range(args.repeats):
        for k, fn in runs.items():  # interleaved, so drift hits every mode alike
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    print(
        f"{args.sequences} sequences, {n_tokens} tokens ({n_scored} scored), dtype {args.dtype}, "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["naive (1 seq/forward)"]
    for k, t in med.items():
        print(f"  {k:<38} {t:7.3f} s  {n_tokens / t:10.0f} tok/s  {base / t:5.2f}x naive")


if __name__ == "__main__":
    main()
