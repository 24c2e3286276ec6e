"""Scoring a run's token shards under torchrun: data-parallel groups, per-group pieces, rank 0 merges.

Every rank runs the same ``mismatch-probe score DIR`` command; ``DIR`` must be on a filesystem
every node sees (NFS, Lustre...). For each missing token shard:

1. every rank reads the shard's rollouts and computes the same token-balanced split over the
   ``dp`` data-parallel groups (:func:`~mismatch_probe.reference.launch.split_by_tokens`);
2. each group scores its sequences (as one training layout: sp x tp ranks) and its first rank
   writes them to ``tokens.parquet/.pieces/part-NNNNN.dp{k}of{dp}.parquet``;
3. after a barrier, rank 0 merges the shard's pieces into ``tokens.parquet/part-NNNNN.parquet``
   (the table one process writes, row for row) and removes them.

A relaunch after a kill skips merged shards and, inside a shard, the pieces already written
(with the same ``dp``), so only what is missing is scored again. Only rank 0 writes run.json.
"""

from __future__ import annotations

import functools
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from mismatch_probe.environment import peak_memory
from mismatch_probe.errors import DataError
from mismatch_probe.table.tokens import (
    ROLLOUTS_DIR,
    TOKEN_SCHEMA,
    TOKENS_DIR,
    merge_pieces,
    piece_name,
    read_rollout_shard,
    shard_name,
    token_table,
    write_table_atomic,
)

if TYPE_CHECKING:
    from mismatch_probe.modeling.logprobs import LogprobSemantics
    from mismatch_probe.reference.launch import Launch

PIECES_DIR = ".pieces"  # pyarrow's dataset reader skips dot-directories: the pieces never count as tokens


def score_data_parallel(ctx: Any, launch: Launch, semantics: LogprobSemantics) -> None:
    """This rank's part of scoring the missing token shards of ``ctx``, a
    ``pipeline.RunContext`` (a higher layer: its attributes are used, its type is not imported)."""
    import torch.distributed as dist

    from mismatch_probe.reference.launch import on_lead, split_by_tokens
    from mismatch_probe.reference.scorer import replay_info, routing_replay

    out, record, progress = ctx.out, ctx.record, ctx.progress
    lead = launch.is_lead
    missing = on_lead(lambda: ctx.missing(TOKENS_DIR))  # one view of the disk for every rank
    if not missing:
        return
    pieces_dir = out / TOKENS_DIR / PIECES_DIR
    t0 = time.perf_counter()
    scorer = _open_scorer(ctx, launch)
    parallel = scorer.parallel
    dp = parallel.dp
    ctx.timings["reference_load_s"] = round(time.perf_counter() - t0, 3)
    reused = scored = 0
    try:
        routing = record.engine.routing if record.engine is not None else None
        width = (len(routing.moe_layers), routing.top_k) if routing else None
        # the routing replay (R3) what-if, as the single-process score stage runs it (pipeline/stages.py)
        replay = routing_replay(ctx.spec.reference.routing_replay, scorer) if routing else None
        options = {"replay": True} if replay is True else {}
        if lead:
            progress.stage("score", sum(len(ctx.shards[i]) for i in missing))
        t0 = time.perf_counter()
        for i in missing:
            rollouts = read_rollout_shard(out / ROLLOUTS_DIR / shard_name(i), width)
            groups = split_by_tokens([len(r.token_ids) for r in rollouts], dp)
            names = [piece_name(i, k, dp) for k in range(dp)]
            done = on_lead(functools.partial(_written, pieces_dir, names))
            reused += sum(done)
            todo = [] if done[parallel.dp_rank] else [rollouts[j] for j in groups[parallel.dp_rank]]
            forwards = 0
            if scorer.fsdp:  # FSDP shards the weights over the data-parallel ranks too: every rank
                # must run as many forwards as the busiest group, whatever its own share
                forwards = max(
                    (len(list(scorer.micro_batches([rollouts[j] for j in g]))) for g, d in zip(groups, done) if not d),
                    default=0,
                )
            if todo or forwards:
                scores = scorer.score(todo, semantics, min_forwards=forwards, **options)
                if todo and parallel.leads_dp_group:
                    table = token_table(
                        todo,
                        scores.logp,
                        scores.entropy,
                        scores.experts,
                        [r.logp_trainer for r in todo],
                        logp_replay=scores.logp_replay,
                    )
                    write_table_atomic(table, pieces_dir / names[parallel.dp_rank])
            scored += sum(not d for d in done)
            dist.barrier()
            if lead:
                _merge(out, i, names, [r.sample_id for r in rollouts])
                progress.advance("score", len(rollouts))
        ctx.timings["scoring_s"] = round(time.perf_counter() - t0, 3)
        peaks: list = [None] * launch.world_size
        dist.all_gather_object(peaks, peak_memory(parallel.device))
        if lead:
            info = scorer.info() | replay_info(replay)
            info["parallel"]["pieces"] = {"scored": scored, "reused_from_an_earlier_launch": reused}
            info["parallel"]["peak_memory_per_rank"] = peaks
            record.update_sections({"reference": info})
            ctx.save()
        dist.barrier()
    finally:
        scorer.close()


def _written(pieces_dir: Path, names: list[str]) -> list[bool]:
    return [(pieces_dir / n).is_file() for n in names]


def _open_scorer(ctx: Any, launch: Launch):
    from mismatch_probe.modeling.loading import resolve_device
    from mismatch_probe.reference.launch import data_parallel_size
    from mismatch_probe.reference.parallel import build_context
    from mismatch_probe.reference.scorer import ReferenceScorer

    spec = ctx.spec.reference
    sp, tp = spec.sequence_parallel_size, spec.tensor_parallel_size
    dp = data_parallel_size(launch.world_size, sp, tp)
    device_type = resolve_device(spec.device)
    device = "cpu" if device_type == "cpu" else f"cuda:{launch.local_rank}"
    parallel = build_context(dp, sp, tp, device_type, device, launcher=launch.describe())
    return ReferenceScorer(ctx.model_path, spec, trust_remote_code=ctx.spec.trust_remote_code, parallel=parallel)


def _merge(out: Path, index: int, names: list[str], sample_ids: list[int]) -> None:
    pieces_dir = out / TOKENS_DIR / PIECES_DIR
    tables = [pq.read_table(pieces_dir / n, schema=TOKEN_SCHEMA) for n in names if (pieces_dir / n).is_file()]
    try:
        merged = merge_pieces(tables, sample_ids)
    except ValueError as exc:
        raise DataError(f"{out / TOKENS_DIR}: shard {index}'s pieces do not add up ({exc})") from None
    write_table_atomic(merged, out / TOKENS_DIR / shard_name(index))
    for stale in pieces_dir.glob(f"part-{index:05d}.*"):  # this launch's and any other dp size's
        stale.unlink(missing_ok=True)
    if not any(pieces_dir.iterdir()):
        shutil.rmtree(pieces_dir, ignore_errors=True)
