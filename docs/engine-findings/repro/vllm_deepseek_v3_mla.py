"""vLLM CPU, DeepSeek-V3 (MLA): its decode log-probs against its own prefill, per engine setting
(docs/engine-findings/vllm-cpu-deepseek-v3-mla.md).

Engine only (no HF reference). For every variant it starts vllm.LLM offline on CPU in a fresh
child process (vLLM does not tear down cleanly in-process), then:
  1. samples `--max-tokens` tokens per prompt (temperature 1, logprobs=0, raw_logprobs):
     the sampled tokens' log-probs come from the decode path (the first one from the prompt's
     prefill);
  2. re-scores prompt + response with prompt_logprobs=0 (one prefill; vLLM skips prefix-cache
     reads for prompt_logprobs requests);
  3. prints K3 = mean(exp(d) - 1 - d), d = logp_prefill - logp_decode, and max |d|, for all
     response tokens, for the first one alone (prefill in both runs) and for the rest (decode).

Variants (--variants, default: all; see VARIANTS): deepseek_v3 in bf16 compiled or eager
(enforce_eager), with vLLM's attention choice (AMX_MLA on a CPU with AMX tiles) or CPU_MLA, with
the rotary embedding's CPU kernel or its torch code (compilation_config custom_ops
"-rotary_embedding"), every layer dense (MLA without MoE), block size 32; glm4_moe (the same
routing without MLA) as the control; float32, which AMX_MLA refuses at start.

    .venv/bin/python docs/engine-findings/repro/vllm_deepseek_v3_mla.py [--variants ds-auto,ds-auto-eager]

One vLLM start per variant, one to three minutes each on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

NATIVE_ROPE = ["-rotary_embedding"]  # the rotary embedding's torch implementation, not vLLM's CPU kernel
VARIANTS = {
    # name: (family, dense, dtype, attention_backend, enforce_eager, block_size, custom_ops)
    "ds-auto": ("deepseek_v3", False, "bfloat16", None, False, None, None),
    "ds-cpumla": ("deepseek_v3", False, "bfloat16", "CPU_MLA", False, None, None),
    "ds-auto-eager": ("deepseek_v3", False, "bfloat16", None, True, None, None),
    "ds-auto-eager-native-rope": ("deepseek_v3", False, "bfloat16", None, True, None, NATIVE_ROPE),
    "ds-cpumla-eager": ("deepseek_v3", False, "bfloat16", "CPU_MLA", True, None, None),
    "ds-cpumla-eager-native-rope": ("deepseek_v3", False, "bfloat16", "CPU_MLA", True, None, NATIVE_ROPE),
    "ds-auto-bs32": ("deepseek_v3", False, "bfloat16", None, False, 32, None),
    "dsdense-auto": ("deepseek_v3", True, "bfloat16", None, False, None, None),
    "dsdense-cpumla": ("deepseek_v3", True, "bfloat16", "CPU_MLA", False, None, None),
    "dsdense-auto-eager": ("deepseek_v3", True, "bfloat16", None, True, None, None),
    "glm-auto": ("glm4_moe", False, "bfloat16", None, False, None, None),
    "glm-auto-eager": ("glm4_moe", False, "bfloat16", None, True, None, None),
    "ds-fp32-auto": ("deepseek_v3", False, "float32", None, False, None, None),
    "ds-fp32-cpumla": ("deepseek_v3", False, "float32", "CPU_MLA", False, None, None),
    "ds-fp32-cpumla-eager": ("deepseek_v3", False, "float32", "CPU_MLA", True, None, None),
    "ds-fp32-cpumla-eager-native-rope": ("deepseek_v3", False, "float32", "CPU_MLA", True, None, NATIVE_ROPE),
}


def build_checkpoint(repo: Path, family: str, dense: bool, out_dir: Path) -> Path:
    """The family suite's tiny checkpoint (tests/tiny_models.py), every layer dense with ``dense``."""
    sys.path.insert(0, str(repo / "tests"))
    import tiny_models  # tests/ has no __init__.py

    layers = tiny_models.FAMILIES[family].kwargs["num_hidden_layers"]
    overrides = {"first_k_dense_replace": layers} if dense else {}
    return tiny_models.build(family, out_dir, **overrides)


def child(a: argparse.Namespace) -> None:
    """One engine: generate, re-score, write the numbers to a.out as JSON."""
    import numpy as np

    sys.path.insert(0, str(a.repo))
    import torch
    from vllm import LLM, SamplingParams

    from mismatch_probe.engines.vllm import sampled_logprobs  # handles FlatLogprobs and dict lists

    _, _, dtype, backend, eager, block_size, custom_ops = VARIANTS[a.variant]
    engine_args = {
        "model": a.model,
        "dtype": dtype,
        "logprobs_mode": "raw_logprobs",  # the adapter's default (raw)
        "seed": 0,  # the adapter's CPU default: sampling draws from the engine seed
        "max_model_len": 512,
        "max_num_seqs": a.max_num_seqs,
        # the adapter sizes the CPU KV cache itself (vLLM's default, 0.92 of the NUMA node, must be free)
        "kv_cache_memory_bytes": 256 << 20,
        "enforce_eager": eager,
    }
    if custom_ops:
        engine_args["compilation_config"] = {"custom_ops": custom_ops}
    if backend:
        engine_args["attention_backend"] = backend  # EngineArgs.attention_backend (arg_utils.py:791)
    if block_size:
        engine_args["block_size"] = block_size
    result: dict = {"variant": a.variant, "engine_args": engine_args, "amx_tiles": torch.cpu._is_amx_tile_supported()}
    try:
        llm = LLM(**engine_args)
    except Exception as e:  # the fp32 refusal lands here
        result["start_error"] = f"{type(e).__name__}: {e}"[:500]
        Path(a.out).write_text(json.dumps(result))
        return
    cfg = llm.llm_engine.vllm_config
    result["effective"] = {
        "attention_backend": str(cfg.attention_config.backend),
        "block_size": cfg.cache_config.block_size,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "dtype": str(cfg.model_config.dtype),
    }

    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(3, 1024, size=a.prompt_len).tolist() for _ in range(a.n_prompts)]
    gen = SamplingParams(
        n=1,
        temperature=1.0,
        max_tokens=a.max_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        skip_special_tokens=False,
        flat_logprobs=True,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], gen, use_tqdm=False)
    full, decode_lp = [], []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        toks = np.asarray(c.token_ids, dtype=np.int64)
        decode_lp.append(sampled_logprobs(c.logprobs, toks).astype(np.float64))
        full.append(np.asarray(p + toks.tolist(), dtype=np.int64))

    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, flat_logprobs=True)
    outs2 = llm.generate([{"prompt_token_ids": f.tolist()} for f in full], score, use_tqdm=False)
    prefill_lp = [
        sampled_logprobs(o.prompt_logprobs, f, first=a.prompt_len).astype(np.float64) for f, o in zip(full, outs2)
    ]

    def stats(d: np.ndarray) -> dict:
        if d.size == 0:
            return {"n": 0}
        k3 = np.exp(d) - 1.0 - d
        return {"n": int(d.size), "k3": float(k3.mean()), "max_abs_delta": float(np.abs(d).max())}

    d_all = np.concatenate([pf - dc for pf, dc in zip(prefill_lp, decode_lp)])
    d_first = np.array([pf[0] - dc[0] for pf, dc in zip(prefill_lp, decode_lp)])
    d_rest = np.concatenate([pf[1:] - dc[1:] for pf, dc in zip(prefill_lp, decode_lp)])
    by_pos = np.stack([pf - dc for pf, dc in zip(prefill_lp, decode_lp)])  # [prompts, max_tokens]
    result.update(
        all=stats(d_all),
        first_token=stats(d_first),
        decoded_tokens=stats(d_rest),
        k3_by_position=[float(x) for x in (np.exp(by_pos) - 1 - by_pos).mean(axis=0)],
    )
    Path(a.out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[3])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, help="build the checkpoints here and keep them")
    # child mode
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return

    import vllm

    print(f"vllm {vllm.__version__}")
    root = a.keep or Path(tempfile.mkdtemp(prefix="mla-repro-"))
    built: dict[tuple[str, bool], Path] = {}
    rows = []
    for name in [v for v in a.variants.split(",") if v]:
        family, dense, *_ = VARIANTS[name]
        key = (family, dense)
        if key not in built:
            built[key] = build_checkpoint(a.repo, family, dense, root / f"tiny-{family}{'-dense' if dense else ''}")
        out = root / f"{name}.json"
        cmd = [
            sys.executable, __file__, "--child", "--repo", str(a.repo), "--variant", name,
            "--model", str(built[key]), "--out", str(out),
            "--n-prompts", str(a.n_prompts), "--prompt-len", str(a.prompt_len),
            "--max-tokens", str(a.max_tokens), "--max-num-seqs", str(a.max_num_seqs), "--seed", str(a.seed),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        log = proc.stdout + proc.stderr
        picked = sorted(
            {
                ln.split("Using ")[1].split(" backend")[0]
                for ln in log.splitlines()
                if "backend." in ln and "Using " in ln
            }
        )
        if not out.exists():
            rows.append({"variant": name, "error": f"rc={proc.returncode}: " + log[-800:]})
            continue
        r = json.loads(out.read_text())
        r["logged_backends"] = picked
        rows.append(r)

    for r in rows:
        if "error" in r or "start_error" in r:
            print(f"{r['variant']:16s} FAILED  {r.get('start_error') or r.get('error')}")
            continue
        al, ft, dt = r["all"], r["first_token"], r["decoded_tokens"]
        print(
            f"{r['variant']:16s} backend={r['logged_backends'] or r['effective']['attention_backend']} "
            f"block={r['effective']['block_size']} prefix_cache={r['effective']['prefix_caching']}  "
            f"K3 all {al['k3']:.3e} (max|d| {al['max_abs_delta']:.3f})  "
            f"first {ft['k3']:.3e}  decoded {dt['k3']:.3e} (max|d| {dt['max_abs_delta']:.3f})"
        )
    (root / "summary.json").write_text(json.dumps(rows, indent=1))
    print(f"details: {root / 'summary.json'}")


if __name__ == "__main__":
    main()
