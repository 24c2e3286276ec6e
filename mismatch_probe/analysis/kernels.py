"""The analysis pass of one shard compiled (numba): every statistic :class:`.metrics.MetricsAccumulator`
and :class:`.peer_metrics.PeerAccumulator` take from a shard's model tokens, in one loop over them.

The NumPy path (:func:`.metrics.cell_stats`, :func:`.terms.sequence_terms`, :func:`.peer_metrics.peer_part`)
makes some forty passes over a shard, most of them through a fresh temporary of every token; its
arithmetic is the fast part. :func:`.metrics.shard_pass` computes the same statistics in one loop, segment by
segment (a sequence, or its part in one turn), with nothing per token kept but what the |delta|
quantiles need (float32 |delta| and its p_infer bucket). :func:`shard_loop` runs it block by block
(:data:`BLOCK_TOKENS` of whole sequences), each block's exp, expm1 and log1p computed first by
NumPy's vector loops (:func:`transcendentals`) into a buffer the size of a block. The NumPy path
stays as it was: the fallback, and the oracle tests/unit/test_kernels.py holds this one to.

Equality with the NumPy path: the terms built from ``delta`` alone (|delta|, K1, K2, the masks and
counts, the position buckets, the float32 |delta| of the quantiles) are the same bits; p_train,
p_infer and the ratio come from NumPy's own exp, and what the loop derives from them (exp(|delta|)
as the ratio or its inverse, the reverse K3, the JS term) is within an ulp or two of NumPy's, as
are the p_infer buckets unless a probability lies within an ulp of an edge. The blocks run in
token order into one state: the same bits as one loop over the shard, whatever the block's size.
Sums run in token order within a segment (a sequence's on over its segments) and then segment by
segment, where
NumPy's are pairwise, so sums agree to rounding (1e-12 relative); the p_infer table sums in token
order as ``bincount`` does. Second moments are two-pass within each segment (its values kept in a
scratch of its length), merged across segments as :class:`.metrics.Moments` merges shards (Chan
et al.).

``MISMATCH_PROBE_NO_NUMBA=1`` (any value but ``0`` or empty) selects the NumPy path, as does a
numba that is absent or does not import (e.g. built against another NumPy). numba is imported on
the first shard, never at import time, so the CLI starts without it. The first call compiles the
loops (the shard's for each dtype of the log-probs: float32 from a table, float64 from a
timeline's step; 7-9 s in all on an idle core, :func:`.metrics.warm_up` does it at once), cached on disk (``cache=True``): in ``__pycache__`` beside this file, or where the
package is read-only in numba's user-wide cache (``~/.cache/numba``; ``NUMBA_CACHE_DIR`` overrides
both); with no writable place the NumPy path runs (compiling in every process would cost more).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

DISABLE_ENV = "MISMATCH_PROBE_NO_NUMBA"

# The loop's output layouts, written here and not read from the NumPy path's key lists: numba's
# cache is keyed on this file alone, so a constant the loop took from another module would stay
# compiled in after that module changed. :func:`.metrics.shard_pass` maps each layout onto its key list by
# name; a key the list gains and the loop does not compute fails there, in one line. (CELL_SUMS,
# CELL_COUNTS, TABLE_ROWS: metrics' SUM_KEYS, COUNT_KEYS, BUCKET_KEYS; PEER_*: peer_metrics' TOKEN_*.)
CELL_SUMS = (
    "k1", "k2", "k3", "abs_delta", "prob_diff", "mult_error", "ratio", "ratio2",
    "k3_kept_token_tis", "k3_kept_token_mask",
)  # fmt: skip
CELL_COUNTS = ("token_tis", "token_mask", "zero_prob_train")
TABLE_ROWS = ("count", "abs_delta", "prob_diff", "k3")
PEER_SUMS = (
    "delta", "abs_delta", "k2", "k3", "reverse_k3", "mult", "rho2", "abs_dp", "js", "r_finite",
    "r_clamped", "oob_tis", "oob_icepop",
)  # fmt: skip
PEER_MAX = ("abs_delta_max", "k3_max", "abs_dp_max", "r_clamped_max")  # peer_metrics.TOKEN_MAX
PEER_MIN = ("abs_delta_min", "k3_min")  # peer_metrics.TOKEN_MIN
# per segment and per sequence: the sequence terms' sums and peer_metrics.SEQUENCE_SUMS
SEGMENT_SUMS = ("logp_train", "logp_infer", "delta", "prob_diff", "k3", "mult_error", "rho2", "abs_delta")
# the moments of a segment, merged across segments: p_train and p_infer (and their co-moment) and
# the ratio, per cell; the rest, the peer metrics' (peer_metrics.TOKEN_M2), per shard
MOMENTS = ("p_train", "p_infer", "ratio", "abs_delta_m2", "k3_m2", "abs_dp_m2", "r_clamped_m2")
FIRST_PEER_MOM = 3

S_K1, S_K2, S_K3, S_ABS_DELTA, S_PROB_DIFF, S_MULT, S_RATIO, S_RATIO2, S_KEPT_TIS, S_KEPT_MASK = range(len(CELL_SUMS))
C_TIS, C_MASK, C_ZERO = range(len(CELL_COUNTS))
_B_COUNT, _B_ABS_DELTA, _B_PROB_DIFF, _B_K3 = range(len(TABLE_ROWS))
(
    T_DELTA, T_ABS_DELTA, T_K2, T_K3, T_REVERSE_K3, T_MULT, T_RHO2, T_ABS_DP, T_JS, T_R_FINITE,
    T_R_CLAMPED, T_OOB_TIS, T_OOB_ICEPOP,
) = range(len(PEER_SUMS))  # fmt: skip
X_AD, X_K3, X_PD, X_RC = range(len(PEER_MAX))
I_AD, I_K3 = range(len(PEER_MIN))
G_LT, G_LI, G_DELTA, G_PROB_DIFF, G_K3, G_MULT, G_RHO2, G_ABS_DELTA = range(len(SEGMENT_SUMS))
M_PT, M_PI, M_R, M_AD, M_K3, M_PD, M_RC = range(len(MOMENTS))
N_SUMS, N_COUNTS, N_BUCKET_ROWS, N_TOKEN_SUMS = len(CELL_SUMS), len(CELL_COUNTS), len(TABLE_ROWS), len(PEER_SUMS)
N_MAX, N_MIN, N_SEG, N_MOM = len(PEER_MAX), len(PEER_MIN), len(SEGMENT_SUMS), len(MOMENTS)
LOGE2 = math.log(2.0)  # np.logaddexp's, for equal arguments
# each token's transcendental terms, rows of :func:`transcendentals`' output
EXPS = ("ratio", "p_train", "p_infer", "expm1_delta", "log1p_small_ratio")
E_R, E_PT, E_PI, E_EM1, E_LOG1P = range(len(EXPS))
N_EXPS = len(EXPS) + 2  # and two rows of scratch: delta, the smaller side of the ratio
# Tokens a block of a shard holds, about (whole sequences): its transcendental terms (56 bytes a
# token) stay in the core's cache, and a shard of any size asks no memory for them beyond a block's.
# Fresh memory is what a process's first shard pays most for: ~1.2 ms per MiB of page faults on the
# 2-core VM measured, where a 1M-token shard's terms at once (53 MiB) cost 70 ms, the loop 25 ms.
BLOCK_TOKENS = 1 << 15


def transcendentals(lt: np.ndarray, li: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Into ``out`` ((N_EXPS, n) float64; its last two rows scratch) and returned: exp(delta),
    exp(logp_train), exp(logp_infer), expm1(delta) and log1p of the ratio's smaller side
    (1 / exp(delta) where delta > 0, else exp(delta): the logaddexp of the JS term), delta =
    logp_train - logp_infer in float64.

    NumPy's vector loops (SIMD where the CPU has it) take ~1-2 ns a value where the compiled loop's
    calls of libm took ~6: computing them here first took 40% off the loop's time."""
    d, small = out[N_EXPS - 2], out[N_EXPS - 1]
    with np.errstate(all="ignore"):  # inf and NaN as the loop's own arithmetic gives them
        np.subtract(lt, li, out=d, dtype=np.float64)
        np.exp(d, out=out[E_R])
        np.exp(lt, out=out[E_PT], dtype=np.float64)
        np.exp(li, out=out[E_PI], dtype=np.float64)
        np.expm1(d, out=out[E_EM1])
        np.divide(1.0, out[E_R], out=small)
        np.copyto(small, out[E_R], where=~(d > 0))
        np.log1p(small, out=out[E_LOG1P])
    return out


def _shard_block(
    lt, li, exps, pos, has_pos, segments, s_from, s_to, n, seg_cell, seg_seq, p_edges, pos_edges, th, state
):
    """One block of a shard's tokens into ``state`` (:func:`_shard_state`): segments ``s_from`` to
    ``s_to`` (``segments``: each segment's first token, of ``n``; segment ``s`` in cell
    ``seg_cell[s]`` and sequence ``seg_seq[s]``, a sequence's segments consecutive and in one
    block); ``exps``: the block's tokens' transcendental terms (:func:`transcendentals`, rows
    E_*, from the block's first token); ``th``: log(token_tis), log(mask low), log(mask high),
    token_tis, mask low, mask high, the peer metrics' ratio clamp (low, high), log 4. The number of
    tokens the table's contract refuses (NaN, +inf, logp_infer = -inf). Plain Python that numba
    compiles (:func:`compiled`); the layouts it fills are this module's (CELL_SUMS, ...)."""
    (
        cell_n, cell_sums, cell_counts, cell_pd_max, cell_p, cell_mean, cell_m2, p_tab, pos_tab, pos_max,
        seg, seg_pd_max, seg_d_min, seq, seq_pd_max, seq_d_min,
        peer_sums, peer_mean, peer_m2, peer_max, peer_min, abs_delta32, p_bucket,
    ) = state  # fmt: skip
    n_segs = segments.shape[0]
    split = False  # a sequence in several segments (turns): its sums run on apart
    for s in range(s_from + 1, s_to):
        split = split or seg_seq[s] == seg_seq[s - 1]
    log_tis, log_low, log_high, tis, low, high = th[0], th[1], th[2], th[3], th[4], th[5]
    rc_lo, rc_hi, log4 = th[6], th[7], th[8]
    n_p, n_pos = p_edges.shape[0] + 1, pos_edges.shape[0] + 1
    first = segments[s_from]
    seg_mean = np.empty(N_MOM)
    seg_m2 = np.empty(N_MOM)
    longest = 0
    for s in range(s_from, s_to):
        longest = max(longest, (segments[s + 1] if s + 1 < n_segs else n) - segments[s])
    scratch = np.empty((longest, N_MOM))
    t_lt = t_li = t_d = t_pd = t_k3 = t_mult = t_rho2 = t_ad = 0.0
    t_pd_max = -np.inf
    t_d_min = np.inf
    n_bad = 0
    n_peer = first - segments[0]  # the tokens merged into the peer moments before this block
    b_pos = 0
    for s in range(s_from, s_to):
        c = seg_cell[s]
        start = segments[s]
        end = segments[s + 1] if s + 1 < n_segs else n
        length = end - start
        s_lt = s_li = s_d = s_ad = s_k2 = s_k3 = s_pd = s_mult = s_r = s_r2 = 0.0
        s_kept_tis = s_kept_mask = s_rk3 = s_rho2 = s_js = s_rfin = s_rc = s_oob_tis = s_oob_ice = 0.0
        s_pt = s_pi = 0.0
        if s == s_from or seg_seq[s] != seg_seq[s - 1]:
            # each sequence's sums run on over its segments, in token order (as reduceat over it sums)
            t_lt = t_li = t_d = t_pd = t_k3 = t_mult = t_rho2 = t_ad = 0.0
            t_pd_max = -np.inf
            t_d_min = np.inf
        n_tis = n_mask = n_zero = 0
        pd_max = ad_max = k3_max = rc_max = -np.inf
        d_min = ad_min = k3_min = np.inf
        # the current run of one position bucket (positions rise within a segment: a few runs)
        run_b = -1
        run_n = 0
        run_ad = run_pd = run_k3 = 0.0
        run_max = -np.inf
        for i in range(start, end):
            a = np.float64(lt[i])
            b = np.float64(li[i])
            if not (a < np.inf and b < np.inf and b > -np.inf):  # NaN, +inf, or logp_infer = -inf
                n_bad += 1
            d = a - b
            r = exps[E_R, i - first]
            pt = exps[E_PT, i - first]
            pi = exps[E_PI, i - first]
            ad = abs(d)
            k2 = d * d
            k2 *= 0.5
            em1 = exps[E_EM1, i - first]
            k3 = em1 - d
            pd = abs(pt - pi)
            # exp(|delta|), exp(-delta) - 1 from exp(delta) and expm1(delta) (an ulp or two from
            # NumPy's own exp of each: two fewer vector passes)
            inv_r = 1.0 / r
            mult = r if d >= 0 else inv_r
            rk3 = (-1.0 if r == np.inf else -em1 * inv_r) + d
            s_lt += a
            s_li += b
            s_d += d
            s_ad += ad
            s_k2 += k2
            s_k3 += k3
            s_pd += pd
            s_mult += mult
            s_r += r
            s_r2 += r * r
            s_pt += pt
            s_pi += pi
            if d > log_tis:
                n_tis += 1
            else:
                s_kept_tis += k3
            if d < log_low or d > log_high:
                n_mask += 1
            else:
                s_kept_mask += k3
            if a == -np.inf:
                n_zero += 1
            pd_max = max(pd_max, pd)
            d_min = min(d_min, d)
            if split:  # loop-invariant: compiled as two loops
                t_lt += a
                t_li += b
                t_d += d
                t_pd += pd
                t_k3 += k3
                t_mult += mult
                t_ad += ad
                t_pd_max = max(t_pd_max, pd)
                t_d_min = min(t_d_min, d)
            # the peer metrics' terms (peer_metrics.token_values, in its order of operations)
            if a == b:  # np.logaddexp's branches
                lae = a + LOGE2
            elif d > 0:
                lae = a + exps[E_LOG1P, i - first]  # log1p(1 / r)
            else:
                lae = b + exps[E_LOG1P, i - first]  # log1p(r)
            js = lae * 2.0
            js -= a
            js -= b
            js -= log4
            js *= 0.5
            rc = min(max(r, rc_lo), rc_hi)
            s_rk3 += rk3
            s_js += js
            s_rc += rc
            s_rho2 += rc * rc
            if split:
                t_rho2 += rc * rc
            if r < np.inf:
                s_rfin += r
            if r > tis:
                s_oob_tis += 1.0
            if r < low or r > high:
                s_oob_ice += 1.0
            ad_max = max(ad_max, ad)
            ad_min = min(ad_min, ad)
            k3_max = max(k3_max, k3)
            k3_min = min(k3_min, k3)
            rc_max = max(rc_max, rc)
            j = i - start  # the segment's values, for its moments' second pass
            scratch[j, M_PT] = pt
            scratch[j, M_PI] = pi
            scratch[j, M_R] = r
            scratch[j, M_AD] = ad
            scratch[j, M_K3] = k3
            scratch[j, M_PD] = pd
            scratch[j, M_RC] = rc
            # the quantiles' per-token state, and the p_infer table in token order (as bincount sums)
            abs_delta32[i] = ad
            bucket = n_p - 1  # most sampled tokens are likely ones: scan down from the top bucket
            while bucket > 0 and pi < p_edges[bucket - 1]:
                bucket -= 1
            p_bucket[i] = bucket
            p_tab[c, bucket, _B_COUNT] += 1.0
            p_tab[c, bucket, _B_ABS_DELTA] += ad
            p_tab[c, bucket, _B_PROB_DIFF] += pd
            p_tab[c, bucket, _B_K3] += k3
            if has_pos:
                p = pos[i]
                while b_pos < n_pos - 1 and p >= pos_edges[b_pos]:
                    b_pos += 1
                while b_pos > 0 and p < pos_edges[b_pos - 1]:
                    b_pos -= 1
                if b_pos != run_b:
                    if run_n:
                        pos_tab[_B_COUNT, c, run_b] += run_n
                        pos_tab[_B_ABS_DELTA, c, run_b] += run_ad
                        pos_tab[_B_PROB_DIFF, c, run_b] += run_pd
                        pos_tab[_B_K3, c, run_b] += run_k3
                        pos_max[c, run_b] = max(pos_max[c, run_b], run_max)
                    run_b = b_pos
                    run_n = 0
                    run_ad = run_pd = run_k3 = 0.0
                    run_max = -np.inf
                run_n += 1
                run_ad += ad
                run_pd += pd
                run_k3 += k3
                run_max = max(run_max, pd)
        if run_n:
            pos_tab[_B_COUNT, c, run_b] += run_n
            pos_tab[_B_ABS_DELTA, c, run_b] += run_ad
            pos_tab[_B_PROB_DIFF, c, run_b] += run_pd
            pos_tab[_B_K3, c, run_b] += run_k3
            pos_max[c, run_b] = max(pos_max[c, run_b], run_max)
        # the segment's moments, two-pass: its means, then the squared deviations from them, less
        # the square of the deviations' own sum (the corrected two-pass: a mean that sums to a
        # rounding off adds no bias)
        m_pt, m_pi, m_r, m_ad = s_pt / length, s_pi / length, s_r / length, s_ad / length
        m_k3, m_pd, m_rc = s_k3 / length, s_pd / length, s_rc / length
        q_pt = q_pi = q_r = q_ad = q_k3 = q_pd = q_rc = co = 0.0
        u_pt = u_pi = u_r = u_ad = u_k3 = u_pd = u_rc = 0.0
        for j in range(length):
            x = scratch[j, M_PT] - m_pt
            y = scratch[j, M_PI] - m_pi
            u_pt += x
            u_pi += y
            q_pt += x * x
            q_pi += y * y
            co += x * y
            x = scratch[j, M_R] - m_r
            u_r += x
            q_r += x * x
            x = scratch[j, M_AD] - m_ad
            u_ad += x
            q_ad += x * x
            x = scratch[j, M_K3] - m_k3
            u_k3 += x
            q_k3 += x * x
            x = scratch[j, M_PD] - m_pd
            u_pd += x
            q_pd += x * x
            x = scratch[j, M_RC] - m_rc
            u_rc += x
            q_rc += x * x
        q_pt -= u_pt * u_pt / length
        q_pi -= u_pi * u_pi / length
        co -= u_pt * u_pi / length
        q_r -= u_r * u_r / length
        q_ad -= u_ad * u_ad / length
        q_k3 -= u_k3 * u_k3 / length
        q_pd -= u_pd * u_pd / length
        q_rc -= u_rc * u_rc / length
        seg_mean[M_PT], seg_mean[M_PI], seg_mean[M_R], seg_mean[M_AD] = m_pt, m_pi, m_r, m_ad
        seg_mean[M_K3], seg_mean[M_PD], seg_mean[M_RC] = m_k3, m_pd, m_rc
        seg_m2[M_PT], seg_m2[M_PI], seg_m2[M_R], seg_m2[M_AD] = q_pt, q_pi, q_r, q_ad
        seg_m2[M_K3], seg_m2[M_PD], seg_m2[M_RC] = q_k3, q_pd, q_rc
        # into the cell (Moments.merge) ...
        na = cell_n[c]
        total = na + length
        if na == 0:
            for k in range(3):
                cell_mean[c, k] = seg_mean[k]
                cell_m2[c, k] = seg_m2[k]
            cell_m2[c, 3] = co
        else:
            w = na * length / total
            dx = seg_mean[M_PT] - cell_mean[c, 0]
            dy = seg_mean[M_PI] - cell_mean[c, 1]
            cell_m2[c, 3] += co + dx * dy * w
            for k in range(3):
                dk = seg_mean[k] - cell_mean[c, k]
                cell_m2[c, k] += seg_m2[k] + dk * dk * w
                cell_mean[c, k] += dk * length / total
        # ... and the peer metrics' into the shard's
        total = n_peer + length
        for k in range(FIRST_PEER_MOM, N_MOM):
            if n_peer == 0:
                peer_mean[k] = seg_mean[k]
                peer_m2[k] = seg_m2[k]
            else:
                dk = seg_mean[k] - peer_mean[k]
                peer_m2[k] += seg_m2[k] + dk * dk * (n_peer * length / total)
                peer_mean[k] += dk * length / total
        n_peer = total
        cell_n[c] = na + length
        cell_sums[c, S_K1] -= s_d
        cell_sums[c, S_K2] += s_k2
        cell_sums[c, S_K3] += s_k3
        cell_sums[c, S_ABS_DELTA] += s_ad
        cell_sums[c, S_PROB_DIFF] += s_pd
        cell_sums[c, S_MULT] += s_mult
        cell_sums[c, S_RATIO] += s_r
        cell_sums[c, S_RATIO2] += s_r2
        cell_sums[c, S_KEPT_TIS] += s_kept_tis
        cell_sums[c, S_KEPT_MASK] += s_kept_mask
        cell_counts[c, C_TIS] += n_tis
        cell_counts[c, C_MASK] += n_mask
        cell_counts[c, C_ZERO] += n_zero
        cell_pd_max[c] = max(cell_pd_max[c], pd_max)
        cell_p[c, 0] += s_pt
        cell_p[c, 1] += s_pi
        seg[s, G_LT] = s_lt
        seg[s, G_LI] = s_li
        seg[s, G_DELTA] = s_d
        seg[s, G_PROB_DIFF] = s_pd
        seg[s, G_K3] = s_k3
        seg[s, G_MULT] = s_mult
        seg[s, G_RHO2] = s_rho2
        seg[s, G_ABS_DELTA] = s_ad
        seg_pd_max[s] = pd_max
        seg_d_min[s] = d_min
        if not split:  # segments are the sequences
            t_lt, t_li, t_d, t_pd, t_k3, t_mult, t_rho2, t_ad = s_lt, s_li, s_d, s_pd, s_k3, s_mult, s_rho2, s_ad
            t_pd_max, t_d_min = pd_max, d_min
        q = seg_seq[s]
        seq[q, G_LT] = t_lt
        seq[q, G_LI] = t_li
        seq[q, G_DELTA] = t_d
        seq[q, G_PROB_DIFF] = t_pd
        seq[q, G_K3] = t_k3
        seq[q, G_MULT] = t_mult
        seq[q, G_RHO2] = t_rho2
        seq[q, G_ABS_DELTA] = t_ad
        seq_pd_max[q] = t_pd_max
        seq_d_min[q] = t_d_min
        peer_sums[T_DELTA] += s_d
        peer_sums[T_ABS_DELTA] += s_ad
        peer_sums[T_K2] += s_k2
        peer_sums[T_K3] += s_k3
        peer_sums[T_REVERSE_K3] += s_rk3
        peer_sums[T_MULT] += s_mult
        peer_sums[T_RHO2] += s_rho2
        peer_sums[T_ABS_DP] += s_pd
        peer_sums[T_JS] += s_js
        peer_sums[T_R_FINITE] += s_rfin
        peer_sums[T_R_CLAMPED] += s_rc
        peer_sums[T_OOB_TIS] += s_oob_tis
        peer_sums[T_OOB_ICEPOP] += s_oob_ice
        peer_max[X_AD] = max(peer_max[X_AD], ad_max)
        peer_max[X_K3] = max(peer_max[X_K3], k3_max)
        peer_max[X_PD] = max(peer_max[X_PD], pd_max)
        peer_max[X_RC] = max(peer_max[X_RC], rc_max)
        peer_min[I_AD] = min(peer_min[I_AD], ad_min)
        peer_min[I_K3] = min(peer_min[I_K3], k3_min)
    return n_bad


def _shard_state(n: int, n_segs: int, n_seqs: int, n_cells: int, n_p: int, n_pos: int) -> tuple:
    """What :func:`_shard_block` accumulates into, before the first token."""
    return (
        np.zeros(n_cells, np.int64),  # cell_n
        np.zeros((n_cells, N_SUMS)),  # cell_sums
        np.zeros((n_cells, N_COUNTS), np.int64),  # cell_counts
        np.full(n_cells, -np.inf),  # cell_pd_max
        np.zeros((n_cells, 2)),  # cell_p: sums of p_train, p_infer (the moments' means, as NumPy's)
        np.zeros((n_cells, 3)),  # cell_mean: running means of p_train, p_infer, ratio ...
        np.zeros((n_cells, 4)),  # cell_m2: ... their m2, and the co-moment of p_train, p_infer
        np.zeros((n_cells, n_p, N_BUCKET_ROWS)),  # p_tab: one bucket's row of sums together, [c, b, :]
        np.zeros((N_BUCKET_ROWS, n_cells, n_pos)),  # pos_tab
        np.full((n_cells, n_pos), -np.inf),  # pos_max
        np.zeros((n_segs, N_SEG)),  # seg
        np.empty(n_segs),  # seg_pd_max
        np.empty(n_segs),  # seg_d_min
        np.zeros((n_seqs, N_SEG)),  # seq
        np.empty(n_seqs),  # seq_pd_max
        np.empty(n_seqs),  # seq_d_min
        np.zeros(N_TOKEN_SUMS),  # peer_sums
        np.zeros(N_MOM),  # peer_mean
        np.zeros(N_MOM),  # peer_m2
        np.full(N_MAX, -np.inf),  # peer_max
        np.full(N_MIN, np.inf),  # peer_min
        np.empty(n, np.float32),  # abs_delta32: the quantiles' per-token state ...
        np.empty(n, np.uint8),  # p_bucket: ... and each token's p_infer bucket
    )


def shard_loop(loops, lt, li, pos, has_pos, segments, seg_cell, seg_seq, n_seqs, n_cells, p_edges, pos_edges, th):
    """One shard through :func:`_shard_block`, block by block (:data:`BLOCK_TOKENS`, cut where a
    sequence begins, so no sequence spans two): the tokens the table's contract refuses, then the
    cells' statistics, the segments' and sequences' sums, the peer metrics' and the quantiles'
    per-token state (layouts: this module's CELL_SUMS, ...). The blocks run in token order into one
    state, so the sums are those of one loop over the shard, bit for bit."""
    n, n_segs = lt.shape[0], segments.shape[0]
    state = _shard_state(n, n_segs, n_seqs, n_cells, p_edges.shape[0] + 1, pos_edges.shape[0] + 1)
    begins = np.flatnonzero(np.diff(seg_seq, prepend=-1))  # each sequence's first segment
    at = np.searchsorted(segments[begins], np.arange(segments[0] + BLOCK_TOKENS, n, BLOCK_TOKENS))
    bounds = np.unique(np.concatenate(([0], begins[at[at < len(begins)]], [n_segs])))
    tokens = np.append(segments, n)[bounds]
    buffer = np.empty(N_EXPS * int(np.diff(tokens).max()))
    n_bad = 0
    for s_from, s_to, first, last in zip(bounds[:-1], bounds[1:], tokens[:-1], tokens[1:], strict=True):
        exps = transcendentals(lt[first:last], li[first:last], buffer[: N_EXPS * (last - first)].reshape(N_EXPS, -1))
        n_bad += loops.shard_block(
            lt, li, exps, pos, has_pos, segments, s_from, s_to, n, seg_cell, seg_seq, p_edges, pos_edges, th, state
        )
    (
        cell_n, cell_sums, cell_counts, cell_pd_max, cell_p, _, cell_m2, p_tab, pos_tab, pos_max,
        seg, seg_pd_max, seg_d_min, seq, seq_pd_max, seq_d_min,
        peer_sums, _, peer_m2, peer_max, peer_min, abs_delta32, p_bucket,
    ) = state  # fmt: skip
    return (
        n_bad,
        (cell_n, cell_sums, cell_counts, cell_pd_max, cell_p, cell_m2, p_tab, pos_tab, pos_max),
        (seg, seg_pd_max, seg_d_min, seq, seq_pd_max, seq_d_min),
        (peer_sums, peer_m2[FIRST_PEER_MOM:].copy(), peer_max, peer_min),
        abs_delta32,
        p_bucket,
    )


def _histogram_loop(bits, cells, hi, hist):
    """:func:`.order_stats.order_statistics`'s first pass over one piece: per cell, the count of each
    bucket of the upper bits (above the lower ``hi``; ``hist`` flat, cell * 2**hi + bucket; a cell
    < 0 is in no group)."""
    for i in range(bits.shape[0]):
        c = cells[i]
        if c >= 0:
            hist[(c << hi) + (bits[i] >> hi)] += 1


def _candidates_loop(bits, cells, hi, pair_of):
    """Its second pass: the values whose (cell, bucket) is a wanted pair (``pair_of``: the pair's
    index or -1), as (pair, lower ``hi`` bits), in value order."""
    pid = np.empty(bits.shape[0], np.int32)
    low = np.empty(bits.shape[0], np.uint16)
    found = 0
    for i in range(bits.shape[0]):
        c = cells[i]
        if c >= 0:
            p = pair_of[(c << hi) + (bits[i] >> hi)]
            if p >= 0:
                pid[found] = p
                low[found] = bits[i] & ((1 << hi) - 1)
                found += 1
    return pid[:found], low[:found]


def _cells_loop(turn, bucket, lut, turn_min, width):
    """Each value's cell for :func:`.order_stats.order_statistics`: ``lut[turn - turn_min]`` (-1: in
    no group), times ``width`` plus its p_infer bucket when ``width`` > 1."""
    out = np.empty(turn.shape[0], np.int64)
    for i in range(turn.shape[0]):
        c = lut[turn[i] - turn_min]
        out[i] = -1 if c < 0 else (c * width + bucket[i] if width > 1 else c)
    return out


class Loops(NamedTuple):
    shard_block: Callable  # _shard_block
    histogram: Callable  # _histogram_loop
    candidates: Callable  # _candidates_loop
    cells: Callable  # _cells_loop


_COMPILED: dict[str, Loops | None] = {}


# Fewer tokens than this in a shard take the NumPy path: importing numba and loading the loops from
# its cache costs 0.3-0.8 s once per process, and the loop saves ~0.1 s per million tokens, so a small
# run (a demo, a test, a short probe) would pay more than it saves. Per shard, from its size alone,
# so the same shards take the same path in any process (their sums agree only to 1e-12 across paths).
COMPILED_MIN_TOKENS = 1 << 16


def compiled(n_tokens: int | None = None) -> Loops | None:
    """The compiled loops, or None for the NumPy path: ``MISMATCH_PROBE_NO_NUMBA`` set, no numba
    that imports, or ``n_tokens`` below :data:`COMPILED_MIN_TOKENS`. (numba compiles each on its
    first call.)"""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    if n_tokens is not None and n_tokens < COMPILED_MIN_TOKENS:
        return None
    if "loops" not in _COMPILED:
        _COMPILED["loops"] = _jit_all()
    return _COMPILED["loops"]


def _jit_all() -> Loops | None:
    try:
        import numba  # type: ignore[import-untyped]
    except Exception:  # absent, or built for another NumPy (it raises ImportError or worse)
        return None
    try:  # x / 0 is inf, as in NumPy
        return Loops(
            *(
                numba.njit(cache=True, nogil=True, error_model="numpy")(fn)
                for fn in (_shard_block, _histogram_loop, _candidates_loop, _cells_loop)
            )
        )
    except RuntimeError:  # no writable cache directory: compiling in every process costs more than it saves
        return None
