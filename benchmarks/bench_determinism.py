"""Determinism and batch invariance of both sides on one device: the `hf` engine and the reference,
each in bfloat16, float16 and float32, on the fixture.

    python benchmarks/bench_determinism.py [--device auto] [--sequences 32] [--json out.json]

Per dtype: the engine samples 2 x N prompts (T = 1, seed 0); its prefill re-scores the first N
twice in one batch, each alone, and reversed among the other N; it samples the N prompts twice
with one seed. The reference (packed, padding-free) scores the same N sequences twice, each alone,
and among the other N. Prints the share of bitwise-equal log-probs and the largest |Δ log p| of
each comparison, all from one run (pipeline/determinism.py computes them, as for a sweep's panel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import smoke  # benchmarks/smoke.py: the --smoke flag

from mismatch_probe.config.spec import EngineSpec, ReferenceSpec, SamplingSpec
from mismatch_probe.engines.base import GenerationRequest
from mismatch_probe.engines.hf import HFEngine
from mismatch_probe.environment import fingerprint
from mismatch_probe.modeling.loading import load_tokenizer, resolve_device, stop_token_ids
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.pipeline.determinism import engine_determinism, reference_batch_invariance
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.rollout.prompts import tokenize_prompts
from mismatch_probe.table.tokens import Rollout

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
PROMPTS = ROOT / "fixtures" / "prompts" / "single_turn.jsonl"
SMOKE = {"sequences": 2, "max_tokens": 8, "dtypes": ["float32"]}  # on --device auto: the CPU without a GPU


def rollouts_from(prompts, completions) -> list[Rollout]:
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = np.concatenate([p, c.token_ids]).astype(np.int32)
        model = np.r_[np.zeros(len(p), bool), np.ones(len(c.token_ids), bool)]
        logp = np.r_[np.zeros(len(p), np.float32), c.logprobs].astype(np.float32)
        out.append(Rollout(i, str(i), ids, np.where(model, 0, -1).astype(np.int16), model, logp, c.finish_reason))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    ap.add_argument("--json", type=Path)
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    device = resolve_device(args.device)
    tok = load_tokenizer(MODEL)
    stops = stop_token_ids(MODEL, tok)
    k = args.sequences
    prompts = [p.token_ids for p in tokenize_prompts(PROMPTS, tok, max_model_len=1024, max_new_tokens=args.max_tokens)]
    prompts = [prompts[i % len(prompts)] for i in range(2 * k)]
    sampling = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.max_tokens, n=1, seed=0)
    env = fingerprint()
    result: dict = {"device": device, "device_name": env["device_name"], "sequences": k, "dtypes": {}}
    for dtype in args.dtypes:
        t = time.perf_counter()
        engine = HFEngine(MODEL, EngineSpec(name="hf", dtype=dtype, device=device, logprobs_mode="raw"))
        requests = [GenerationRequest(p, args.max_tokens) for p in prompts]
        rollouts = rollouts_from(prompts, engine.generate(requests, sampling, stop_token_ids=stops, seed=0))
        side = {"engine": engine_determinism(engine, rollouts[:k], rollouts[k:], sampling, stop_token_ids=stops)}
        engine.close()
        scorer = ReferenceScorer(MODEL, ReferenceSpec(dtype=dtype, device=device, logits_fp32=True, packing=True))
        side["reference"] = reference_batch_invariance(scorer, rollouts[:k], rollouts[k:], LogprobSemantics("raw"))
        side["seconds"] = round(time.perf_counter() - t, 1)
        del scorer
        result["dtypes"][dtype] = side
    print(f"{result['device_name']} ({device}), {k} sequences of up to {args.max_tokens} sampled tokens")
    print(f"  {'dtype':<9} {'side':<10} {'comparison':<28} {'bitwise equal':>13} {'max |Δ log p|':>14}")
    for dtype, side in result["dtypes"].items():
        rows = [("engine", name, v) for name, v in (side["engine"]["prefill"] or {}).items()]
        rows.append(("engine", "same seed, sampled twice", side["engine"]["same_seed"]))
        rows += [("reference", name, v) for name, v in side["reference"].items() if isinstance(v, dict)]
        for who, name, v in rows:
            share = v.get("bitwise_equal_share")
            delta = v.get("max_abs_delta")
            extra = f" (same tokens {v['identical_tokens_share']:.0%})" if "identical_tokens_share" in v else ""
            print(
                f"  {dtype:<9} {who:<10} {name.replace('_', ' '):<28} "
                f"{'-' if share is None else f'{share:.1%}':>13} {'-' if delta is None else f'{delta:.2e}':>14}{extra}"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
