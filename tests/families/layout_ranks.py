"""Every family's reference in the training layouts (TP=2, Ulysses SP=2), in one pair of ranks.

Spawning the ranks (a torch + transformers import each) costs ~12 s on 2 cores, more than
scoring a tiny model; so, for the conformance suite, two ranks are spawned once and take every
family in turn: on each rank, the reference's own ``ReferenceScorer`` over a ``(dp, sp, tp)``
mesh of this process group, exactly as a spawned rank of ``DistributedReferenceScorer`` runs it
(that wrapper is tested on its own in tests/e2e/test_parallel_reference.py). A refusal (the
layout's own check, as the parent runs it before spawning) comes back as the reason.
"""

from __future__ import annotations

import datetime
import queue
import tempfile
import traceback

import numpy as np

LAYOUTS = {"reference_tp2": (1, 2), "reference_sp2": (2, 1)}  # column -> (sp, tp)
BUDGET = 160  # tokens per packed micro-batch: several per call, each cut over the ranks


def layout_spec(sp: int, tp: int):
    from mismatch_probe.config.spec import ReferenceSpec

    return ReferenceSpec(
        dtype="float32",
        sequence_parallel_size=sp,
        tensor_parallel_size=tp,
        max_tokens_per_micro_batch=BUDGET,
        device="cpu",
    )


def _rank_main(rank: int, init_method: str, jobs: list, rollouts, results) -> None:
    import torch.distributed as dist

    from mismatch_probe.errors import ConfigError
    from mismatch_probe.modeling.logprobs import LogprobSemantics
    from mismatch_probe.reference.distributed import check_reference_layout
    from mismatch_probe.reference.parallel import build_context
    from mismatch_probe.reference.scorer import ReferenceScorer

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    for family, path in jobs:
        for column, (sp, tp) in LAYOUTS.items():
            spec = layout_spec(sp, tp)
            try:
                check_reference_layout(path, spec, gpus=False)
                ctx = build_context(1, sp, tp, "cpu", "cpu")
                scorer = ReferenceScorer(path, spec, parallel=ctx)
                scores = scorer.score(rollouts, LogprobSemantics("raw"))
                info = scorer.info()
                scorer.close()
            except ConfigError as exc:
                outcome = ("refused", exc.message)
            except Exception:
                outcome = ("error", traceback.format_exc())
            else:
                lp = np.concatenate([x[r.is_model_token] for x, r in zip(scores.logp, rollouts)])
                outcome = ("ok", (lp, info.get("parallel", {})))
            if rank == 0:
                results.put((family, column, outcome))
            if outcome[0] == "error":
                return  # the other rank may be stuck in a collective: the parent stops both
    dist.destroy_process_group()


def score_layouts(paths: dict, rollouts, timeout_s: float = 600) -> dict:
    """``{(family, column): ("ok", (logp, parallel info)) | ("refused", reason) | ("error", traceback)}``."""
    import torch.multiprocessing as mp

    store = tempfile.mkdtemp(prefix="mismatch-probe-families-")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(
        _rank_main,
        nprocs=2,
        join=False,
        start_method="spawn",
        args=(f"file://{store}/store", list(paths.items()), rollouts, results),
    )
    out: dict = {}
    want = len(paths) * len(LAYOUTS)
    try:
        while len(out) < want:
            try:
                family, column, outcome = results.get(timeout=timeout_s)
            except queue.Empty:
                break
            out[(family, column)] = outcome
            if outcome[0] == "error":
                break
    finally:
        for p in procs.processes:
            p.join(timeout=30 if len(out) == want else 0)
            if p.is_alive():
                p.kill()
    return out
