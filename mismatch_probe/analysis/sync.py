"""The weight-sync probe's numbers and findings (ARCHITECTURE.md, Weight sync). Pure functions.

Three comparisons separate the sync path's error from the kernels' mismatch:

- *fidelity*: the synced engine's prefill log-probs of a fixed token set against a fresh engine's
  (loaded from the same weights) on the same tokens: the error the sync added, nothing else;
- *weights*: a digest of every engine parameter (``engines/weight_sync.py: module_digest``) after
  the sync, against the fresh engine's and against the synced engine's before the sync: which
  parameter is wrong, and how (not updated, rounded, rows or experts in another order);
- *stale cache*: decode against prefill with the prefix cache holding entries computed with the
  old weights, against the same after a reset.

Every finding is a dict ``{"kind", "parameters", "message"}``; :data:`FINDING_KINDS` says what each means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mismatch_probe.record import StaleCache, SyncRepeat

FINDING_KINDS = {
    "not_updated": "a parameter kept the weights the engine started from",
    "untied_lm_head": "the engine's LM head is a tensor of its own that the sync did not update",
    "precision": "a parameter arrived rounded (sent through a lower-precision dtype)",
    "permuted_rows": "a fused parameter's rows arrived in another order (q/k/v or gate/up shards swapped)",
    "permuted_experts": "a MoE layer's experts arrived in another order",
    "weights_differ": "a parameter differs from a fresh load in another way",
    "logprobs_differ": "the synced engine's log-probs differ from a fresh engine's on the same tokens",
    "stale_prefix_cache": "the prefix cache kept entries computed with the old weights",
    "drift_over_repeats": "syncing the same weights again changed the engine",
}
# a digest entry of the weight a layer's kernel applies, beside its parameter (vLLM's CPU GEMMs)
KERNEL_SUFFIX = "[kernel]"
# |difference| / RMS of a parameter under which a difference is rounding, not another tensor
ROUNDING_SHARE = 1e-2
# |Δ log p| between the same greedy requests with a stale cache and after a reset from which it is a
# finding: an engine decodes the same batch the same way, so below this is kernel noise at most
STALE_MIN_ABS = 1e-3
# ... and how many times the engine's own floor it must be: the same requests answered from the
# entries the clean answers left against recomputed (``stale_cache``'s ``floor``). Kernels that are not
# batch invariant (CPU kernels without AMX) give a cache hit other log-probs than a recomputation
STALE_FLOOR_FACTOR = 4.0


def finding(kind: str, message: str, parameters: Sequence[str] = ()) -> dict:
    assert kind in FINDING_KINDS, kind
    return {"kind": kind, "parameters": list(parameters), "message": message}


def logprob_fidelity(synced: np.ndarray, fresh: np.ndarray) -> dict:
    """Synced against fresh log-probs of the same tokens (finite pairs only): the share that is
    bitwise equal, the largest |difference| and K3 with the fresh engine in the reference's place
    (``mean(exp(d) - 1 - d)``, ``d = fresh - synced``)."""
    a = np.asarray(synced, np.float64)
    b = np.asarray(fresh, np.float64)
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size == 0:
        return {"tokens": 0, "bitwise_share": None, "max_abs_dlogp": None, "k3": None}
    d = b - a
    return {
        "tokens": int(a.size),
        "bitwise_share": float(np.mean(np.asarray(synced)[keep] == np.asarray(fresh)[keep])),
        "max_abs_dlogp": float(np.max(np.abs(d))),
        "k3": float(np.mean(np.expm1(d) - d)),
    }


def _rows_equal_as_sets(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    return bool(np.array_equal(a[np.lexsort(a.T[::-1])], b[np.lexsort(b.T[::-1])]))


def weight_findings(
    before: Mapping[str, np.ndarray],
    after: Mapping[str, np.ndarray],
    fresh: Mapping[str, np.ndarray],
    *,
    n_experts: int | None = None,
) -> tuple[list[str], list[dict]]:
    """Which parameters of the synced engine (``after``) differ from a fresh load's (``fresh``),
    and what each difference is, from digests ``[rows, (sum, sum of squares)]``; ``before`` is the
    synced engine's own digest before the sync (the weights it started from). A parameter only
    the synced engine has (the fresh one holds it tied to another) is compared with ``before``."""
    differing: list[str] = []
    found: list[dict] = []
    for name in sorted(set(after) | set(fresh)):
        a = after.get(name)
        f = fresh.get(name)
        if a is not None and f is not None and np.array_equal(a, f):
            continue
        differing.append(name)
        if f is None:
            embedding = next((fresh[k] for k in fresh if k.endswith("embed_tokens.weight")), None)
            if (
                name.endswith("lm_head.weight")
                and a is not None
                and embedding is not None
                and np.array_equal(a, embedding)
            ):
                differing.pop()  # a head of its own that the engine's loader filled from the embedding again
                continue
            # before the sync it was tied, so its start weights are the embedding's then
            start = before.get(name, next((before[k] for k in before if k.endswith("embed_tokens.weight")), None))
            if name.endswith("lm_head.weight") and a is not None and start is not None and np.array_equal(a, start):
                found.append(
                    finding(
                        "untied_lm_head",
                        f"{name} is a tensor of its own in the synced engine and kept the weights it started from; "
                        "a fresh engine ties it to the embedding, which the sync did update",
                        [name],
                    )
                )
            else:
                found.append(finding("weights_differ", f"{name} exists only in the synced engine", [name]))
            continue
        if a is None:
            found.append(finding("weights_differ", f"{name} is missing from the synced engine", [name]))
            continue
        b = before.get(name)
        if b is not None and np.array_equal(a, b) and name.endswith(KERNEL_SUFFIX):
            found.append(
                finding(
                    "not_updated",
                    f"{name.removesuffix(KERNEL_SUFFIX)}: the copy its GEMM kernel applies (repacked at load) kept the "
                    "weights the engine started from, though the parameter itself was updated: the engine's update "
                    "path did not re-process this layer (a tied LM head shares the embedding's parameter, not its kernel)",
                    [name],
                )
            )
            continue
        if b is not None and np.array_equal(a, b):
            found.append(
                finding(
                    "not_updated",
                    f"{name} kept the weights the engine started from: the sync did not update it",
                    [name],
                )
            )
            continue
        if _rows_equal_as_sets(a, f):
            experts = n_experts if n_experts and "expert" in name and a.shape[0] % n_experts == 0 else None
            if experts:
                per = a.shape[0] // experts
                ea, ef = a.reshape(experts, per, 2), f.reshape(experts, per, 2)
                order = [next((j for j in range(experts) if np.array_equal(ea[i], ef[j])), -1) for i in range(experts)]
                moved = [i for i, j in enumerate(order) if j != i]
                if -1 not in order:
                    found.append(
                        finding(
                            "permuted_experts",
                            f"{name}: experts {moved} hold other experts' weights ({', '.join(f'{i} has {order[i]}' for i in moved)})",
                            [name],
                        )
                    )
                    continue
            found.append(
                finding(
                    "permuted_rows",
                    f"{name} holds the right rows in another order: shards of the fused parameter "
                    "(q/k/v or gate/up) were loaded into each other's places",
                    [name],
                )
            )
            continue
        rms = np.sqrt(np.sum(f[:, 1]) / max(1, f.shape[0])) or 1.0
        worst = float(np.max(np.abs(a[:, 0] - f[:, 0])))
        if worst < ROUNDING_SHARE * rms:
            found.append(
                finding(
                    "precision",
                    f"{name} differs from a fresh load by rounding (largest row-sum difference {worst:.3g}, "
                    f"{worst / rms:.2g} of the row norm): it was sent through a lower-precision dtype",
                    [name],
                )
            )
        else:
            found.append(finding("weights_differ", f"{name} holds other weights than a fresh load", [name]))
    return differing, _distinct(found)


def _distinct(found: list[dict]) -> list[dict]:
    """One finding per kind and parameter set, in a stable order."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    out = []
    for f in found:
        key = (f["kind"], tuple(f["parameters"]))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def stale_cache(stale: np.ndarray, clean: np.ndarray) -> dict:
    """The same greedy requests decoded with the prefix cache holding the old weights' entries
    (``stale``) and after a reset (``clean``), their log-probs on the tokens both chose alike:
    :func:`logprob_fidelity` with the reset side in the fresh side's place."""
    return logprob_fidelity(stale, clean)


def stale_beyond_floor(stale: dict) -> bool:
    """Whether a stale cache moved the greedy answers beyond kernel noise: by at least
    :data:`STALE_MIN_ABS`, and :data:`STALE_FLOOR_FACTOR` times what a cache hit alone moves them
    on this engine and machine (``floor``; absent in runs made before it was measured)."""
    cache = StaleCache.model_validate(stale)
    moved, floor = cache.max_abs_dlogp or 0.0, cache.floor.get("max_abs_dlogp") or 0.0
    return moved >= STALE_MIN_ABS and moved > STALE_FLOOR_FACTOR * floor


def vs_fresh_k3(
    synced: np.ndarray, fresh: np.ndarray, reference: np.ndarray, sample_ids: np.ndarray, *, n_boot: int = 2000
) -> dict:
    """K3 against the reference of the synced engine's prefill and of the fresh engine's, on the
    same tokens, with the sequence-bootstrap interval of their difference (paired: both resampled
    with the same counts); within noise when the interval covers 0."""
    from mismatch_probe.analysis.intervals import paired_intervals

    s, f, r = (np.asarray(x, np.float64) for x in (synced, fresh, reference))
    keep = np.isfinite(s) & np.isfinite(f) & np.isfinite(r)
    s, f, r, ids = s[keep], f[keep], r[keep], np.asarray(sample_ids)[keep]
    if s.size == 0:
        return {"tokens": 0}
    order = np.argsort(ids, kind="stable")
    s, f, r, ids = s[order], f[order], r[order], ids[order]
    uniq, starts, counts = np.unique(ids, return_index=True, return_counts=True)

    def columns(engine: np.ndarray) -> dict:
        d = r - engine
        return {
            "sample_id": uniq,
            "turn": np.zeros(len(uniq), np.int64),
            "n_tokens": counts.astype(np.float64),
            "k3_sum": np.add.reduceat(np.expm1(d) - d, starts),
        }

    a, b = columns(f), columns(s)
    k3_fresh, k3_synced = float(a["k3_sum"].sum() / s.size), float(b["k3_sum"].sum() / s.size)
    interval = paired_intervals(a, b, ["k3_kl"], n_boot=n_boot)["k3_kl"] if len(uniq) > 1 else None
    diff = interval.difference if interval is not None else None
    return {
        "tokens": int(s.size),
        "k3_synced": k3_synced,
        "k3_fresh": k3_fresh,
        "difference": k3_synced - k3_fresh,
        "interval": [diff.low, diff.high] if diff is not None else None,
        "within_noise": bool(diff.covers(0.0)) if diff is not None else None,
    }


def sync_findings(repeats: list[dict], stale: dict | None, rollouts: dict | None = None) -> list[dict]:
    """The run's findings: each repeat's weight findings (once), log-probs that differ from a fresh
    engine's (the prompts after each repeat, ``rollouts`` on the sampled tokens) where the weights
    did not say why, a stale prefix cache, and a sync of the same weights that changed the engine again."""
    out: list[dict] = []
    for r in repeats:
        for f in r.get("weight_findings", []):
            if all((f["kind"], f["parameters"]) != (g["kind"], g["parameters"]) for g in out):
                out.append(f)
    if not out:
        sides = [(f"after sync {r['repeat']}, on the prompts", r.get("fidelity")) for r in repeats]
        sides.append(("on the sampled tokens", rollouts))
        bad = [(where, fid) for where, fid in sides if fid and fid.get("bitwise_share", 1.0) not in (None, 1.0)]
        if bad:
            where, fid = bad[0]
            out.append(
                finding(
                    "logprobs_differ",
                    f"{where}, the engine's prefill log-probs differ from a fresh engine's on "
                    f"{1 - fid['bitwise_share']:.1%} of {fid['tokens']} tokens (max |Δ log p| "
                    f"{fid['max_abs_dlogp']:.3g}, K3 {fid['k3']:.3g})",
                )
            )
    if stale is not None and stale_beyond_floor(stale):
        floor = StaleCache.model_validate(stale).floor.get("max_abs_dlogp")
        out.append(
            finding(
                "stale_prefix_cache",
                "with the prefix cache holding entries computed with the old weights, the same greedy requests "
                f"decode differently from after a reset: {1 - stale['bitwise_share']:.1%} of {stale['tokens']} "
                f"tokens differ, max |Δ log p| {stale['max_abs_dlogp']:.3g}, K3 {stale['k3']:.3g}"
                + (f" (a cache hit alone moves them by at most {floor:.3g} here)" if floor else "")
                + ": reset the prefix cache after every weight update",
            )
        )
    syncs = [SyncRepeat.model_validate(r) for r in repeats]
    differing = [r.weights.get("differing") for r in syncs]
    fidelity = [r.fidelity.get("max_abs_dlogp") for r in syncs]
    changed = [
        r["repeat"]
        for r, d, f in zip(repeats[1:], differing[1:], fidelity[1:])
        if d != differing[0] or f != fidelity[0]
    ]
    if changed:
        out.append(
            finding(
                "drift_over_repeats",
                f"syncing the same weights again changed the engine: repeats {changed} differ from a fresh load "
                "otherwise than the first",
            )
        )
    return out
