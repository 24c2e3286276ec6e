"""Per-rank peak memory of loading the reference model for a training layout: ``from_pretrained`` in
one process vs sharded loading (meta device + each rank's own safetensors slices,
mismatch_probe.modeling.sharded_loading) over 2 ranks with TP=2 and with FSDP2, vs 2 ranks that
``from_pretrained`` the whole model and then shard it.

    .venv/bin/python benchmarks/bench_sharded_loading.py [--model PATH] [--dtype float32] [--hidden 2048 ...]

Without --model a random dense Qwen2 checkpoint (float32, untied; ~2.4 GiB by default) is written to a
temporary directory first. Every rank is a fresh process (gloo on CPU, file:// store), so each measures
only itself, from /proc/self/status: its resident set just before loading (the baseline: torch,
transformers and the process group, loaded already) and its peak resident set (VmHWM; anonymous *and*
file-backed pages). The headline peak is read once every weight the rank holds has been read: loaded
in the checkpoint's own dtype, ``from_pretrained`` on CPU leaves the weights as views of the
memory-mapped file, resident only once touched (the "loaded" column shows that lazy figure). A short
forward follows, whose logits are compared with the one-process model's as a sanity check (under
FSDP2 it all-gathers, so "+fwd" is the layout's working memory, not loading). Ratios are to the
one-process figures; the target is a per-rank peak at 2 ranks of at most 0.6x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# mode: (ranks, what it does)
MODES = {
    "from_pretrained": (1, "1 process: from_pretrained"),
    "meta+tp": (2, "TP=2: build_on_meta + apply_tensor_parallel + load_local_shards"),
    "meta+fsdp": (2, "FSDP2 x2: build_on_meta + fully_shard + load_local_shards"),
    "full+tp": (2, "TP=2: from_pretrained, then apply_tensor_parallel"),
    "full+fsdp": (2, "FSDP2 x2: from_pretrained, then fully_shard"),
}
TARGET = 0.6
FORWARD_TOKENS = 16
# a checkpoint of the fixture's size; sharded loading over TP=2 beside the one process
SMOKE = {
    "hidden": 256,
    "intermediate": 512,
    "layers": 2,
    "heads": 4,
    "kv_heads": 4,
    "vocab": 1024,
    "modes": "from_pretrained,meta+tp",
}


# ---- memory ----------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """This process's peak resident set. VmHWM rather than ru_maxrss: on Linux ru_maxrss carries the
    forking parent's peak over exec, VmHWM belongs to this process's own address space."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the checkpoint --------------------------------------------------------------------------


def make_checkpoint(out: Path, args) -> None:
    """A random Qwen2 checkpoint in float32, written tensor by tensor (no model is initialized)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.dtype = "float32"
    config.save_pretrained(out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen).mul_(0.02)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# ---- one rank --------------------------------------------------------------------------------


def _tensor_parallel(model, ctx) -> None:
    """The reference's own plan (mismatch_probe.reference.parallel.apply_tensor_parallel): the
    config's base_model_tp_plan on the decoder's Linear layers (embeddings and LM head replicated)."""
    from mismatch_probe.reference.parallel import apply_tensor_parallel

    apply_tensor_parallel(model.base_model, ctx)


def _fully_shard(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def worker(args) -> None:
    import gc

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (imported before the baseline)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mismatch_probe.modeling.loading import causal_lm_class
    from mismatch_probe.modeling.sharded_loading import build_on_meta, load_local_shards
    from mismatch_probe.reference.parallel import build_context

    hf_logging.disable_progress_bar()
    causal_lm_class(Path(args.model), trust_remote_code=False)  # transformers' lazy imports: not timed
    mode, rank, world = args.worker, args.rank, args.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = ctx = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        if mode.endswith("+tp"):  # the reference's (dp, sp, tp) mesh, made before the baseline like FSDP's
            ctx = build_context(1, 1, world, "cpu", "cpu")
    dtype = getattr(torch, args.dtype)
    baseline = rss_bytes()

    t0 = time.perf_counter()
    record = None
    if mode.startswith("meta+"):
        model = build_on_meta(Path(args.model), dtype=args.dtype, attn_implementation="sdpa", trust_remote_code=False)
        _tensor_parallel(model, ctx) if mode == "meta+tp" else _fully_shard(model, mesh)
        record = load_local_shards(model, Path(args.model), "cpu")
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").eval()
        if mode == "full+tp":
            _tensor_parallel(model, ctx)
        elif mode == "full+fsdp":
            _fully_shard(model, mesh)
    gc.collect()
    load_s = time.perf_counter() - t0
    if world > 1:
        dist.barrier()
    peak_loaded = peak_rss_bytes()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    held = sum(t.numel() * t.element_size() for t in local)
    with torch.no_grad():  # read every weight this rank holds: pages of a memory-mapped one become resident
        for t in local:
            t.sum()
    del local
    peak = peak_rss_bytes()

    ids = torch.arange(3, 3 + FORWARD_TOKENS)[None] % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    peak_forward = peak_rss_bytes()
    out = Path(args.out)
    if rank == 0:
        np.save(out / f"{mode}.logits.npy", logits.float().numpy())
    result = {
        "mode": mode,
        "rank": rank,
        "world": world,
        "load_s": load_s,
        "baseline": baseline,
        "peak_loaded": peak_loaded,
        "peak": peak,
        "peak_forward": peak_forward,
        "params_held": held,
        "record": record,
    }
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# ---- driver ----------------------------------------------------------------------------------


def _python(**flags) -> list[str]:
    """This script in a fresh interpreter, with ``--flag value`` for each keyword (``_`` -> ``-``)."""
    argv = [sys.executable, str(Path(__file__).resolve())]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def run_mode(mode: str, model: Path, dtype: str, out: Path) -> list[dict]:
    world = MODES[mode][0]
    store = out / f"{mode}.store"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs = [
        subprocess.Popen(
            _python(worker=mode, rank=r, world=world, store=store, model=model, dtype=dtype, out=out), env=env
        )
        for r in range(world)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{mode}: rank exit codes {codes}")
    return [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local Hugging Face checkpoint (default: write a random Qwen2 one)")
    ap.add_argument("--dtype", default="float32", help="the dtype to load in")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--keep", action="store_true", help="keep the temporary checkpoint and results")
    smoke.add_flag(ap)
    # internal: one rank / the checkpoint writer, each in a fresh process
    ap.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--make-checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    if args.worker:
        worker(args)
        return
    if args.make_checkpoint:
        make_checkpoint(Path(args.make_checkpoint), args)
        return

    modes = [m for m in args.modes.split(",") if m]
    if "from_pretrained" not in modes:
        modes.insert(0, "from_pretrained")  # the ratios are to it
    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-loading-"))
    try:
        model = Path(args.model) if args.model else tmp / "model"
        if not args.model:
            t0 = time.perf_counter()
            sizes = {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")}
            subprocess.run(_python(make_checkpoint=model, **sizes), check=True)
            print(f"wrote a random Qwen2 checkpoint in {time.perf_counter() - t0:.1f} s: {model}")
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"checkpoint: {model} ({size / 2**30:.2f} GiB of safetensors), loaded as {args.dtype}")
        print(f"{os.cpu_count()} CPU cores; ranks share them (torch threads = cores / ranks)\n")
        results = {}
        for mode in modes:
            results[mode] = run_mode(mode, model, args.dtype, tmp)
        _report(results, tmp)
        if args.keep:
            print(f"\nkept: {tmp}")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _report(results: dict, out: Path) -> None:
    import numpy as np

    gib = 2**30
    one = results["from_pretrained"][0]
    ref_logits = np.load(out / "from_pretrained.logits.npy")
    head = (
        f"{'layout':<62} {'rank':>4} {'load s':>6} {'baseline':>8} {'loaded':>7} {'peak':>7} {'/1p':>6} "
        f"{'above base':>10} {'/1p':>6} {'+fwd':>7} {'params':>7} {'read':>7} {'max|dlogit|':>11}"
    )
    print(head)
    print("-" * len(head))
    worst: dict[str, float] = {}
    for mode, ranks in results.items():
        logits = np.load(out / f"{mode}.logits.npy")
        diff = float(np.abs(logits - ref_logits).max())
        for r in ranks:
            above = r["peak"] - r["baseline"]
            read = f"{r['record']['bytes_read'] / gib:.2f}G" if r["record"] else "-"
            print(
                f"{MODES[mode][1]:<62} {r['rank']:>4} {r['load_s']:>6.1f} {r['baseline'] / gib:>7.2f}G "
                f"{r['peak_loaded'] / gib:>6.2f}G {r['peak'] / gib:>6.2f}G {r['peak'] / one['peak']:>5.2f}x "
                f"{above / gib:>9.2f}G {above / (one['peak'] - one['baseline']):>5.2f}x "
                f"{r['peak_forward'] / gib:>6.2f}G {r['params_held'] / gib:>6.2f}G {read:>7} {diff:>11.3g}"
            )
        worst[mode] = max(r["peak"] for r in ranks) / one["peak"]
    print(
        "\nbaseline: resident before loading (torch + transformers imported, process group up); loaded: peak "
        "resident (VmHWM) once loaded;\npeak: VmHWM once every weight the rank holds has been read (a "
        "memory-mapped weight is resident only once touched);\nabove base: peak - baseline; /1p: ratio to the "
        "one-process figure; +fwd: VmHWM after one forward of "
        f"{FORWARD_TOKENS} tokens;\nparams: this rank's parameter bytes; read: safetensors bytes it read; "
        "max|dlogit|: that forward's logits vs the one-process model's"
    )
    for mode, ratio in worst.items():
        if MODES[mode][0] > 1:
            verdict = "meets" if ratio <= TARGET else "misses"
            print(f"{mode:<10} worst rank peak {ratio:.2f}x the one-process peak: {verdict} the {TARGET}x target")


if __name__ == "__main__":
    main()
