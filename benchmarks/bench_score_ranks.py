"""Scoring throughput and per-rank peak memory of `mismatch-probe score`: one process against
2 torchrun ranks in each layout.

    python benchmarks/bench_score_ranks.py [--hidden 2048 --layers 8] [--prompts 8 --n 4 --max-tokens 64]
        [--layouts one,dp2,tp2,sp2,fsdp2]

1. samples a run from the fixture (`probes/demo-hf.toml`, hf engine) once;
2. builds a random Qwen2 checkpoint with the fixture's vocabulary and tokenizer, big enough for the
   forward to dominate (default ~390M parameters, 1.6 GB in float32, untied), so `score --model`
   scores the same token ids with it;
3. scores the run with it, through the real CLI, in float32: one process, then `torchrun
   --standalone --nproc-per-node 2` as DP=2, DP=1 x TP=2, DP=1 x SP=2 and FSDP2 over DP=2, each
   into its own directory.

Prints each layout's scoring time (run.json `timings.scoring_s`: the forward passes, pieces and
merges, not the model load), scored tokens per second and the ratio to one process, the load
time, how the weights were loaded (whole on every rank, or each rank its own slices: TP and FSDP)
and each rank's peak resident memory as run.json records it (`reference.peak_memory`,
`reference.parallel.peak_memory_per_rank`), with its ratio to one process. On a machine with C
cores, one process uses C threads and each of 2 ranks C/2, so the throughput ratio says what the
layout costs or gains on the same cores, not what 2 GPUs give. Every layout runs with
`MALLOC_MMAP_THRESHOLD_=1048576` (see `reference/parallel.py: CPU_MALLOC_ENV`), one process too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "models" / "tiny-qwen2"
BIN = Path(sys.executable).parent
# --layouts: the short names, and each layout's name in the table
LAYOUTS = {
    "one": "1 process",
    "dp2": "torchrun DP=2",
    "tp2": "torchrun DP=1 x TP=2",
    "sp2": "torchrun DP=1 x SP=2",
    "fsdp2": "torchrun FSDP2 DP=2",
}
# a model of the fixture's size, one torchrun layout beside the one process
SMOKE = {"hidden": 256, "layers": 2, "intermediate": 512, "prompts": 2, "n": 1, "max_tokens": 8, "layouts": "one,tp2"}


def build_model(out: Path, hidden: int, layers: int, intermediate: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(FIXTURE)
    config.hidden_size, config.num_hidden_layers, config.intermediate_size = hidden, layers, intermediate
    config.num_attention_heads, config.num_key_value_heads = 16, 4
    config.head_dim = hidden // 16
    config.tie_word_embeddings = False
    config.layer_types = ["full_attention"] * layers  # one per layer, as the fixture's
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURE / name, out / name)
    return out


def scored(run: Path) -> dict:
    import pyarrow.parquet as pq

    rec = json.loads((run / "run.json").read_text())
    tokens = pq.read_table(run / "tokens.parquet", columns=["logp_train"]).column("logp_train")
    ref = rec["reference"]
    per_rank = ref.get("parallel", {}).get("peak_memory_per_rank") or [ref["peak_memory"]]
    return {
        "scoring_s": rec["timings"]["scoring_s"],
        "load_s": rec["timings"]["reference_load_s"],
        "tokens": len(tokens) - tokens.null_count,
        "loading": "own slices" if ref["loading"]["method"].startswith("meta") else "whole model",
        "peak_rss": [m["rss_bytes"] for m in per_rank],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--work", type=Path, help="keep the run and the model here (default: a temporary directory)")
    ap.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)} (one is always run)"
    )
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    chosen = {"one", *(k for k in args.layouts.split(",") if k)}
    if unknown := chosen - set(LAYOUTS):
        ap.error(f"unknown layouts {sorted(unknown)}; choose of {', '.join(LAYOUTS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-score-ranks-"))
    work.mkdir(parents=True, exist_ok=True)
    mp = str(BIN / "mismatch-probe")
    run = work / "run"
    if not (run / "run.json").is_file():
        subprocess.run(
            [mp, "sample", str(ROOT / "probes" / "demo-hf.toml"), "--out", str(run), "--set",
             f"max_prompts={args.prompts}", "--set", f"sampling.n={args.n}", "--set",
             f"sampling.max_tokens={args.max_tokens}"],
            check=True,
        )  # fmt: skip
    model = work / "model"
    if not (model / "config.json").is_file():
        build_model(model, args.hidden, args.layers, args.intermediate)
    n_params = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 4
    fp32 = ["--model", str(model), "--set", "reference.dtype=float32", "--overwrite"]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--no-python", mp]
    commands = {
        "one": [mp],
        "dp2": torchrun,
        "tp2": [*torchrun, "--set", "reference.tensor_parallel_size=2"],
        "sp2": [*torchrun, "--set", "reference.sequence_parallel_size=2"],
        "fsdp2": [*torchrun, "--set", "reference.fsdp=true", "--set", "reference.fsdp_param_dtype=float32"],
    }
    layouts = {LAYOUTS[k]: cmd for k, cmd in commands.items() if k in chosen}
    results = {}
    for name, cmd in layouts.items():
        out = work / name.replace(" ", "-").replace("=", "").lower()
        head, extra = (cmd[:1], []) if len(cmd) == 1 else (cmd[: len(torchrun)], cmd[len(torchrun) :])
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
        subprocess.run([*head, "score", str(run), "--out", str(out), *fp32, *extra], check=True, env=env)
        results[name] = scored(out)
    base = results["1 process"]
    print(f"\nmodel: {n_params / 1e6:.0f}M parameters (float32), {base['tokens']} scored tokens; work dir {work}")
    print(
        f"{'layout':<22}{'scoring s':>10}{'tokens/s':>9}{'vs 1':>7}{'load s':>8}  {'weights':<12}"
        f"{'peak RSS per rank (GiB)':>24}{'vs 1':>7}"
    )
    for name, r in results.items():
        rss = r["peak_rss"]
        print(
            f"{name:<22}{r['scoring_s']:>10.2f}{r['tokens'] / r['scoring_s']:>9.0f}"
            f"{base['scoring_s'] / r['scoring_s']:>6.2f}x{r['load_s']:>8.1f}  {r['loading']:<12}"
            f"{' / '.join(f'{b / 2**30:.2f}' for b in rss):>24}{max(rss) / base['peak_rss'][0]:>6.2f}x"
        )
    if args.smoke and args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
