"""Reference scoring throughput on the fixture: padding-free packing (per-sequence "varlen" SDPA, the
default, and transformers' dense block-mask SDPA) vs padded micro-batches vs a naive loop (one
sequence per forward through the model's own forward, full-vocab logits).

    python benchmarks/bench_reference.py [--sequences 256] [--dtype float32] [--repeats 3] [--device cuda]

Sequences are fixture prompts followed by random "responses" of mixed lengths (16-400 tokens),
the length spread RL batches have. Prints tokens/s per mode and the ratios, all from one run.
In bfloat16/float16 it also times the default packed mode with its LM head in float32 (what
``--logits-fp32`` costs). ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import smoke  # benchmarks/smoke.py: the --smoke flag

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.modeling.loading import load_tokenizer, resolve_device
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.rollout.prompts import tokenize_prompts
from mismatch_probe.table.tokens import Rollout

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
PROMPTS = ROOT / "fixtures" / "prompts" / "single_turn.jsonl"
SMOKE = {"sequences": 4, "repeats": 1}  # on the fixture (the default --model); --device auto: the CPU without a GPU


def make_rollouts(n: int, seed: int = 0, model: Path = MODEL) -> list[Rollout]:
    tok = load_tokenizer(model)
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
    device = next(model.parameters()).device
    for r in rollouts:
        with torch.inference_mode():
            ids = torch.from_numpy(r.token_ids.astype(np.int64)).to(device)
            logits = model(input_ids=ids[None]).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            pos = torch.from_numpy(np.flatnonzero(r.is_model_token)).to(device)
            lp[pos - 1, ids[pos]].cpu().numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", type=Path, default=MODEL, help="a checkpoint (benchmarks/random_checkpoint.py)")
    ap.add_argument("--json", type=Path)
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    device = resolve_device(args.device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    torch.manual_seed(0)
    rollouts = make_rollouts(args.sequences, model=args.model)
    n_tokens = sum(len(r.token_ids) for r in rollouts)
    n_scored = sum(int(r.is_model_token.sum()) for r in rollouts)
    sem = LogprobSemantics("raw")
    packed = {"packing": True, "micro_batch_size": 64, "max_tokens_per_micro_batch": 4096}
    modes = {
        "packed, varlen sdpa (default)": ReferenceScorer(
            args.model, ReferenceSpec(dtype=args.dtype, device=device, **packed)
        ),
        "padded (16 seq/mb)": ReferenceScorer(
            args.model, ReferenceSpec(dtype=args.dtype, device=device, packing=False, micro_batch_size=16)
        ),
    }
    if args.dtype != "float32":  # a float32 reference computes its LM head in float32 anyway
        modes["packed, varlen, fp32 LM head"] = ReferenceScorer(
            args.model, ReferenceSpec(dtype=args.dtype, device=device, logits_fp32=True, **packed)
        )
    # transformers' own packed path: sdpa with a dense block-diagonal [T x T] mask per micro-batch
    dense = ReferenceScorer(args.model, ReferenceSpec(dtype=args.dtype, device=device, **packed))
    dense.model.set_attn_implementation("sdpa")
    dense.varlen = False
    modes["packed, dense block mask (hf sdpa)"] = dense
    naive_model = modes["padded (16 seq/mb)"].model
    runs = {k: (lambda s=s: s.score(rollouts, sem)) for k, s in modes.items()}
    runs["naive (1 seq/forward)"] = lambda: naive(naive_model, rollouts)
    for fn in runs.values():  # warm-up
        fn()
    sync()
    times = {k: [] for k in runs}
    for _ in range(args.repeats):
        for k, fn in runs.items():  # interleaved, so drift hits every mode alike
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    where = (
        torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    )
    print(
        f"{args.model.name}: {args.sequences} sequences, {n_tokens} tokens ({n_scored} scored), dtype {args.dtype}, "
        f"{where}, median of {args.repeats}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["naive (1 seq/forward)"]
    for k, t in med.items():
        print(f"  {k:<38} {t:7.3f} s  {n_tokens / t:10.0f} tok/s  {base / t:5.2f}x naive")
    head = med.get("packed, varlen, fp32 LM head")
    if head is not None:
        print(
            f"  the fp32 LM head costs {head / med['packed, varlen sdpa (default)'] - 1:+.1%} of the packed mode's time"
        )
    if args.json:
        figures = {k: {"seconds": t, "tokens_per_s": n_tokens / t, "x_naive": base / t} for k, t in med.items()}
        summary = {
            "device": where,
            "model": args.model.name,
            "dtype": args.dtype,
            "sequences": args.sequences,
            "tokens": n_tokens,
        }
        args.json.write_text(json.dumps({**summary, "modes": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
