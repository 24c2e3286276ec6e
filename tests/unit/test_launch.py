"""Pure parts of scoring under torchrun: reading its environment, the token-balanced split over
data-parallel groups, and merging the groups' pieces back into the table one process writes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mismatch_probe.errors import ConfigError
from mismatch_probe.reference.launch import data_parallel_size, split_by_tokens, torchrun_launch
from mismatch_probe.table.tokens import Rollout, merge_pieces, token_table

TORCHRUN_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job7",
}


def test_torchrun_environment_is_read():
    launch = torchrun_launch(TORCHRUN_ENV)
    assert launch is not None
    assert (launch.rank, launch.world_size, launch.local_rank, launch.node_rank, launch.nnodes) == (3, 4, 1, 1, 2)
    assert not launch.is_lead
    assert launch.describe() == "torchrun: 4 ranks on 2 node(s) x 2 (rendezvous node0:29500, run id job7)"


@pytest.mark.parametrize("drop", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_without_torchrun_there_is_no_launch(drop):
    assert torchrun_launch({k: v for k, v in TORCHRUN_ENV.items() if k != drop}) is None


def test_a_garbled_environment_is_a_config_error():
    with pytest.raises(ConfigError, match="does not parse"):
        torchrun_launch({**TORCHRUN_ENV, "WORLD_SIZE": "four"})


def test_data_parallel_size_divides_the_world():
    assert data_parallel_size(8, 2, 2) == 2
    assert data_parallel_size(2, 1, 1) == 2
    with pytest.raises(ConfigError, match="do not split into groups of sequence-parallel 1 x tensor-parallel 4"):
        data_parallel_size(6, 1, 4)


def _best_spread(lengths, parts):
    """The smallest possible max-min spread of group totals, by brute force (small inputs)."""
    best = None
    for assign in itertools.product(range(parts), repeat=len(lengths)):
        totals = np.bincount(assign, weights=lengths, minlength=parts)
        spread = totals.max() - totals.min()
        best = spread if best is None else min(best, spread)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_split_by_tokens_covers_everything_once_balanced_and_in_order(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, size=int(rng.integers(1, 9)))
    parts = int(rng.integers(1, 4))
    groups = split_by_tokens(lengths, parts)
    assert len(groups) == parts
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)
    totals = [int(lengths[g].sum()) if g else 0 for g in groups]
    # greedy longest-first is within the longest sequence of the best split (LPT bound)
    assert max(totals) - min(totals) <= _best_spread(lengths, parts) + lengths.max()
    assert split_by_tokens(lengths, parts) == groups  # deterministic: every rank computes the same


def test_split_by_tokens_by_hand():
    assert split_by_tokens([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]  # 10 | 8+1+1
    assert split_by_tokens([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties to the lowest group
    assert split_by_tokens([3], 3) == [[0], [], []]  # more groups than sequences: some idle
    assert split_by_tokens([], 2) == [[], []]


def _rollouts(n: int) -> list[Rollout]:
    rng = np.random.default_rng(0)
    out = []
    for sid in range(n):
        k = int(rng.integers(3, 9))
        mask = np.arange(k) >= 2
        out.append(
            Rollout(
                100 + sid,
                f"p{sid // 2}",
                rng.integers(0, 50, k).astype(np.int32),
                np.where(mask, 0, -1).astype(np.int16),
                mask,
                np.where(mask, -rng.random(k), np.nan).astype(np.float32),
                "stop",
            )
        )
    return out


def _scores(rollouts):
    logp = [np.where(r.is_model_token, -0.01 * r.sample_id, np.nan).astype(np.float32) for r in rollouts]
    return logp, [np.where(r.is_model_token, 1.0, np.nan).astype(np.float32) for r in rollouts]


def test_merged_pieces_are_the_table_one_process_writes():
    rollouts = _rollouts(7)
    whole = token_table(rollouts, *_scores(rollouts))
    groups = split_by_tokens([len(r.token_ids) for r in rollouts], 3)
    pieces = []
    for g in reversed(groups):  # the order pieces are read in does not matter
        part = [rollouts[i] for i in g]
        pieces.append(token_table(part, *_scores(part)))
    merged = merge_pieces(pieces, [r.sample_id for r in rollouts])
    assert merged.equals(whole)


def test_pieces_that_miss_or_repeat_a_sample_are_refused():
    rollouts = _rollouts(4)
    table = token_table(rollouts[:3], *_scores(rollouts[:3]))
    ids = [r.sample_id for r in rollouts]
    with pytest.raises(ValueError, match="3 samples, not the shard's 4"):
        merge_pieces([table], ids)
    with pytest.raises(ValueError):
        merge_pieces([table, table], ids[:3])
    with pytest.raises(ValueError):
        merge_pieces([table], [1, 2, 3])
