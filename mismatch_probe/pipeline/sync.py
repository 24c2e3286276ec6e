"""The weight-sync probe inside a run (ARCHITECTURE.md, Weight sync): the sample stage's engine
starts from another checkpoint and receives the run's model through its own update path before it
samples; a fresh engine loaded from the model then scores the same tokens, so the error the sync
path adds is measured apart from the kernels' mismatch.

Sample stage (:func:`sample_synced`), in order:

1. the engine starts from ``sync.start_from`` (``perturbed``: built here, ``sync/start-perturbed/``)
   and digests its parameters;
2. ``warm_cache``: it samples the prompts once, so its prefix cache holds the old weights' entries;
3. each of ``repeats`` syncs (``engine.sync_weights``: the colocate cycle, the transfer, the cache
   reset as set), digests its parameters and re-scores the prompts with its prefill (the fixed token
   set of every repeat); between repeats it samples the prompts again;
4. the run's rollouts are sampled as in any run (decode, then the engine's own prefill);
5. ``warm_cache`` without a reset: the prompts decoded greedily before the rollouts (the cache holds
   the old weights' entries) and again after a reset, then once more (the cache now holds the new
   weights' entries: the engine's own floor of a cache hit against a recomputation): the
   stale-cache comparison;
6. the synced engine prefills every rollout as the fresh engine will (``sync/synced-prefill.parquet``);
7. the engine closes, and a fresh engine loaded from the model digests its parameters and prefills
   the prompts and every rollout: ``sync/fresh-prefill.parquet``.

Synced and fresh engine score the same tokens in the same requests and batches (steps 3, 6 and 7):
an engine whose kernels are not batch invariant (SGLang's and vLLM's CPU kernels without AMX)
gives other log-probs for the same tokens in another batch composition, which is not the sync's
doing. The analyze stage (:func:`analyze_sync`) joins both prefills with the token table (the
reference) into run.json's ``sync`` section.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import PERTURBED, SamplingSpec
from mismatch_probe.engines.base import GenerationRequest, ScoreRequest
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import portable_path
from mismatch_probe.pipeline.runs import ENGINE_LOG, RunContext, timed
from mismatch_probe.table.tokens import ROLLOUTS_DIR, read_rollout_shard, shard_name, write_table_atomic

SYNC_DIR = "sync"
FRESH_PREFILL = "fresh-prefill.parquet"
SYNCED_PREFILL = "synced-prefill.parquet"  # the synced engine's prefill of the rollouts, as the fresh one's
WARM_MAX_TOKENS = 1  # a warm-up request only needs its prompt's blocks in the cache
STALE_CHECK_TOKENS = 8  # greedy tokens per prompt that compare a stale cache with a reset one
GREEDY = SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, max_tokens=STALE_CHECK_TOKENS, n=1, seed=0)
REMOTE = "remote"  # the engine of a running server (engines/remote/)


def _prompt_ids(ctx: RunContext) -> list[np.ndarray]:
    assert ctx.inputs is not None
    return [np.asarray(p.token_ids, np.int32) for p in ctx.inputs.prompts]


def start_checkpoint(ctx: RunContext) -> Path:
    """The checkpoint the engine starts from: a directory, or the perturbed model built once in the run."""
    from mismatch_probe.engines.weight_sync import perturbed_checkpoint

    start = ctx.spec.sync.start_from
    assert start is not None
    if start == PERTURBED and ctx.spec.engine.name == REMOTE:
        raise ConfigError(
            "sync.start_from = 'perturbed' makes a checkpoint a server would have to be started from",
            hint="start the server from the weights before the step and give that directory as sync.start_from "
            "(the server must serve it)",
        )
    if start == PERTURBED:
        return perturbed_checkpoint(ctx.model_path, ctx.out / SYNC_DIR / "start-perturbed")
    return Path(start)  # checked against the model by the prepare stage (modeling/loading.py: check_sync_start)


def _prefill(engine, sequences: list[np.ndarray], starts: list[int]) -> list[np.ndarray]:
    return engine.prefill_logprobs([ScoreRequest(ids, s) for ids, s in zip(sequences, starts)])


def _sample_prompts(engine, ctx: RunContext, max_tokens: int, seed: int) -> list:
    assert ctx.inputs is not None
    requests = [GenerationRequest(ids, max_tokens) for ids in _prompt_ids(ctx)]
    return engine.generate(requests, ctx.spec.sampling, stop_token_ids=ctx.inputs.stop_token_ids, seed=seed)


def _greedy_prompts(engine, ctx: RunContext) -> list:
    """The prompts decoded greedily for a few tokens: the same requests give the same answers unless
    what the engine reuses (its prefix cache) changed."""
    assert ctx.inputs is not None
    requests = [GenerationRequest(ids, STALE_CHECK_TOKENS) for ids in _prompt_ids(ctx)]
    return engine.generate(requests, GREEDY, stop_token_ids=ctx.inputs.stop_token_ids, seed=0)


def _common_prefix_logprobs(stale: list, clean: list) -> tuple[np.ndarray, np.ndarray]:
    """Each answer's log-probs over the tokens both sides chose alike (greedy answers part where the
    stale cache changed the argmax; what follows is another context, not comparable)."""
    a, b = [], []
    for x, y in zip(stale, clean):
        n = min(len(x.token_ids), len(y.token_ids))
        differ = np.flatnonzero(np.asarray(x.token_ids[:n]) != np.asarray(y.token_ids[:n]))
        k = int(differ[0]) + 1 if differ.size else n  # the first differing token's own log-prob still compares
        a.append(np.asarray(x.logprobs[:k]))
        b.append(np.asarray(y.logprobs[:k]))
    return (np.concatenate(a), np.concatenate(b)) if a else (np.zeros(0), np.zeros(0))


def sample_synced(ctx: RunContext, missing: list[int], sample_shards) -> None:
    """The sample stage of a run with ``[sync]`` (module docstring); ``sample_shards`` samples the
    run's rollout shards with an engine, as in any run."""
    from mismatch_probe.analysis.sync import logprob_fidelity, stale_cache, weight_findings
    from mismatch_probe.engines.process import EngineProcess
    from mismatch_probe.engines.weight_sync import fault_from_env

    spec, out, record, progress = ctx.spec, ctx.out, ctx.record, ctx.progress
    sync = spec.sync
    assert ctx.inputs is not None
    entry = ctx.inputs.entry
    sync_dir = out / SYNC_DIR
    sync_dir.mkdir(exist_ok=True)
    fault = fault_from_env()  # tests only
    start = start_checkpoint(ctx)
    prompts = _prompt_ids(ctx)
    timings: dict = {"sync_s": []}
    progress.log(
        f"[sync] starting engine {entry.name} from {portable_path(start)} (log: {portable_path(out / ENGINE_LOG)})"
    )
    t0 = time.perf_counter()
    with timed(ctx.timings, "engine_start_s"):
        engine = EngineProcess(
            entry,
            start,
            spec.engine,
            log_path=out / ENGINE_LOG,
            trust_remote_code=spec.trust_remote_code,
            state_dir=out / ROLLOUTS_DIR / ".received",
            sync=sync,
        )
    timings["engine_start_s"] = round(time.perf_counter() - t0, 3)
    repeats: list[dict] = []
    digests: dict[str, dict] = {}
    stale = None
    try:
        if not engine.capabilities.prefill:
            raise ConfigError(
                f"engine {entry.name!r} cannot re-score tokens with its own prefill, which the sync probe compares",
                hint="sync with the vllm or sglang engine",
            )
        if engine.capabilities.weight_digest:
            digests["before"] = engine.weight_digest(sync_dir / "digest-before.npz")
        if sync.warm_cache:
            _sample_prompts(engine, ctx, WARM_MAX_TOKENS, seed=spec.sampling.seed)
        for r in range(1, sync.repeats + 1):
            progress.log(f"[sync] {r}/{sync.repeats}: {sync.transfer} transfer into {entry.name}")
            report = engine.sync_weights(ctx.model_path, sync_dir / "trainer-checkpoint", fault=fault)
            timings["sync_s"].append(report.get("seconds"))
            if engine.capabilities.weight_digest:
                digests[f"repeat-{r}"] = engine.weight_digest(sync_dir / f"digest-repeat-{r}.npz")
            scored = _prefill(engine, prompts, [1] * len(prompts))
            np.savez(sync_dir / f"prompts-synced-{r}.npz", *scored)
            repeats.append({"repeat": r, "report": report})
            if r < sync.repeats:  # sampling between syncs, as a training step does
                _sample_prompts(engine, ctx, spec.sampling.max_tokens, seed=spec.sampling.seed + r)
        stale_answers = _greedy_prompts(engine, ctx) if sync.warm_cache and not sync.reset_prefix_cache else None
        sample_shards(ctx, engine, missing)
        if stale_answers is not None:
            # the run's rollouts were decoded with the old weights' entries in the cache: the same
            # greedy requests before and after a reset tell what those entries changed; once more,
            # from the entries the clean answers left, what a cache hit alone changes (the floor)
            engine.reset_prefix_cache()
            clean = _greedy_prompts(engine, ctx)
            stale = stale_cache(*_common_prefix_logprobs(stale_answers, clean))
            stale["floor"] = stale_cache(*_common_prefix_logprobs(_greedy_prompts(engine, ctx), clean))
        _write_prefill(ctx, engine, SYNCED_PREFILL)
    finally:
        with timed(ctx.timings, "engine_stop_s"):
            engine.close()
        record.engine_process = engine.describe()

    fresh_prompts = None
    if entry.name == REMOTE:  # the server now holds the synced weights: no fresh load to compare with
        fresh_unavailable = (
            "a server is started by its owner, not by the probe, so no fresh load of the model is compared; "
            "start a second server from the model and probe it for the baseline"
        )
    else:
        fresh_unavailable = None
        progress.log(f"[sync] fresh engine {entry.name} from {portable_path(ctx.model_path)}: the baseline")
        t0 = time.perf_counter()
        fresh = EngineProcess(
            entry,
            ctx.model_path,
            spec.engine,
            log_path=out / ENGINE_LOG,
            trust_remote_code=spec.trust_remote_code,
            sync=sync,
        )
        timings["fresh_engine_start_s"] = round(time.perf_counter() - t0, 3)
        try:
            if fresh.capabilities.weight_digest:
                digests["fresh"] = fresh.weight_digest(sync_dir / "digest-fresh.npz")
            fresh_prompts = _prefill(fresh, prompts, [1] * len(prompts))
            _write_prefill(ctx, fresh, FRESH_PREFILL)
        finally:
            fresh.close()

    # the transfer's checkpoint and the perturbed start are the size of the model: a resume rebuilds them
    shutil.rmtree(sync_dir / "trainer-checkpoint", ignore_errors=True)
    if spec.sync.start_from == PERTURBED:
        shutil.rmtree(sync_dir / "start-perturbed", ignore_errors=True)
    n_experts = _n_experts(ctx)
    for item in repeats:
        r = item["repeat"]
        with np.load(sync_dir / f"prompts-synced-{r}.npz") as data:
            synced = [data[f"arr_{i}"] for i in range(len(prompts))]
        item["fidelity"] = (
            logprob_fidelity(np.concatenate(synced), np.concatenate(fresh_prompts))
            if fresh_prompts is not None
            else {"unavailable": fresh_unavailable}
        )
        if "fresh" in digests:
            differing, found = weight_findings(
                digests["before"], digests[f"repeat-{r}"], digests["fresh"], n_experts=n_experts
            )
            item["weights"] = {"compared": len(digests["fresh"]), "differing": differing}
            item["weight_findings"] = found
        else:
            item["weights"] = {"unavailable": f"the {entry.name} engine does not expose its parameters"}
    # the digests and the prompts' log-probs served the findings above (in run.json); a resume redoes them
    for path in [*sync_dir.glob("digest-*.npz"), *sync_dir.glob("prompts-synced-*.npz")]:
        path.unlink()
    record.update_sections(
        {
            "sync": {
                "settings": sync.model_dump(),
                "engine": entry.name,
                # the perturbed start is rebuilt from the model on demand (and not kept)
                "start_checkpoint": PERTURBED if sync.start_from == PERTURBED else portable_path(start),
                "fault_injected": fault,
                "repeats": repeats,
                "stale_cache": stale,
                "timings": timings,
                "fresh_unavailable": fresh_unavailable,
                "complete": False,  # the analyze stage adds the comparisons with the reference
            }
        }
    )
    ctx.save()


def _write_prefill(ctx: RunContext, engine, name: str) -> None:
    """An engine's prefill of every rollout (from its first position; NaN before), one row per
    sample, in ``sync/NAME``: shard by shard, one request per rollout, as both engines do it."""
    import pyarrow as pa

    ids, logps = [], []
    for i in range(len(ctx.shards)):
        rollouts = read_rollout_shard(ctx.out / ROLLOUTS_DIR / shard_name(i), None)
        scored = _prefill(engine, [r.token_ids for r in rollouts], [1] * len(rollouts))
        for r, lp in zip(rollouts, scored):
            ids.append(r.sample_id)
            logps.append(np.concatenate([[np.nan], lp]).astype(np.float32))
    table = pa.table({"sample_id": pa.array(ids, pa.int64()), "logp": pa.array(logps, pa.list_(pa.float32()))})
    write_table_atomic(table, ctx.out / SYNC_DIR / name)


def _n_experts(ctx: RunContext) -> int | None:
    """The routed experts of a MoE checkpoint (the run's ``architecture``: modeling/architecture.py), else None."""
    moe = ctx.record.moe()
    return moe.get("routed_experts")


def sync_incomplete(ctx: RunContext) -> bool:
    """A run with [sync] whose sample stage did not finish its sync probe (it redoes the stage)."""
    if not ctx.spec.sync.enabled:
        return False
    section = ctx.record.sync
    if section is None:
        return True
    if not (ctx.out / SYNC_DIR / SYNCED_PREFILL).is_file() and section.get("complete") is False:
        return True  # written by this version's sample stage, which did not finish it
    return section.get("fresh_unavailable") is None and not (ctx.out / SYNC_DIR / FRESH_PREFILL).is_file()


def restart_sample_stage(ctx: RunContext) -> None:
    """The sync probe's state lived in the engine that was stopped: sample every shard again."""
    shutil.rmtree(ctx.out / ROLLOUTS_DIR, ignore_errors=True)
    (ctx.out / ROLLOUTS_DIR).mkdir()


def analyze_sync(ctx: RunContext) -> dict | None:
    """run.json's ``sync`` section, complete: the sample stage's measurements, the fidelity and the
    K3 against the reference of the synced and the fresh prefill on the rollouts' model tokens, and
    the findings."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from mismatch_probe.analysis.sync import logprob_fidelity, sync_findings, vs_fresh_k3
    from mismatch_probe.table.tokens import TOKENS_DIR

    section = ctx.record.sync
    if section is None:
        return None
    section = dict(section)
    if section.get("fresh_unavailable"):
        unavailable = {"unavailable": section["fresh_unavailable"]}
        section.update(fidelity=unavailable, vs_fresh=unavailable)
        section["findings"] = sync_findings(section.get("repeats", []), section.get("stale_cache"))
        section["routing"] = _routing_note(ctx)
        section["clean"] = not section["findings"]
        section["complete"] = True
        return section
    table = ds.dataset(ctx.out / TOKENS_DIR, format="parquet").to_table(
        columns=["sample_id", "position", "is_model_token", "logp_prefill", "logp_train"]
    )
    sample = table.column("sample_id").to_numpy()
    position = table.column("position").to_numpy()
    model = table.column("is_model_token").to_numpy(zero_copy_only=False)
    reference = table.column("logp_train").to_numpy(zero_copy_only=False).astype(np.float64)
    fresh_values = _by_position(pq.read_table(ctx.out / SYNC_DIR / FRESH_PREFILL), sample, position)
    if (ctx.out / SYNC_DIR / SYNCED_PREFILL).is_file():  # scored in the fresh engine's batches
        synced = _by_position(pq.read_table(ctx.out / SYNC_DIR / SYNCED_PREFILL), sample, position)
    else:  # a run sampled before the synced engine re-scored the rollouts: its sample stage's prefill
        synced = table.column("logp_prefill").to_numpy(zero_copy_only=False).astype(np.float64)
    m = model.astype(bool)
    section["fidelity"] = logprob_fidelity(synced[m], fresh_values[m])
    section["vs_fresh"] = vs_fresh_k3(synced[m], fresh_values[m], reference[m], sample[m])
    repeats = section.get("repeats", [])
    section["findings"] = sync_findings(repeats, section.get("stale_cache"), section["fidelity"])
    section["routing"] = _routing_note(ctx)
    section["clean"] = not section["findings"]
    section["complete"] = True
    return section


def _by_position(fresh, sample: np.ndarray, position: np.ndarray) -> np.ndarray:
    """An engine's prefill log-prob of each token-table row (``sample``, ``position``), from its rows
    of one list per sample (:func:`_write_prefill`; ``logp_fresh`` in runs made before it); NaN
    where it has none."""
    out = np.full(len(sample), np.nan)
    if fresh.num_rows == 0:
        return out
    lists = fresh.column("logp" if "logp" in fresh.column_names else "logp_fresh").combine_chunks()
    values = lists.flatten().to_numpy(zero_copy_only=False).astype(np.float64)
    offsets = lists.offsets.to_numpy()
    ids = fresh.column("sample_id").to_numpy()
    order = np.argsort(ids, kind="stable")
    row = order[np.minimum(np.searchsorted(ids[order], sample), len(ids) - 1)]
    start, length = offsets[row], offsets[row + 1] - offsets[row]
    ok = (ids[row] == sample) & (position >= 0) & (position < length)
    out[ok] = values[(start + position)[ok]]
    return out


def _routing_note(ctx: RunContext) -> dict | None:
    routing = ctx.record.engine.routing if ctx.record.engine is not None else None
    if _n_experts(ctx) is None:
        return None
    if routing is None:
        info = ctx.record.engine.to_dict() if ctx.record.engine is not None else {}
        return {"unavailable": info.get("routing_unavailable") or "the engine does not report its routing"}
    return {"available": True}
