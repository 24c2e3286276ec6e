"""What a run's samples were, from its rollout shards: finish reasons and response lengths
(run.json's ``samples``), for the report's "the run" card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe.table.tokens import ROLLOUTS_DIR, list_values, shard_paths


def sample_summary(run_dir: str | Path) -> dict[str, Any]:
    """Finish reasons (counts), empty responses, and the mean and largest number of model tokens
    a sample has, over every rollout shard of ``run_dir``."""
    finish: dict[str, int] = {}
    counts = []
    for path in shard_paths(Path(run_dir), ROLLOUTS_DIR):
        t = pq.read_table(path, columns=["is_model_token", "finish_reason"])
        reasons, n = np.unique(t.column("finish_reason").to_numpy(zero_copy_only=False), return_counts=True)
        for reason, k in zip(reasons, n):
            finish[str(reason)] = finish.get(str(reason), 0) + int(k)
        mask, offsets = list_values(t.column("is_model_token"), np.int64)
        cum = np.concatenate([[0], np.cumsum(mask)])
        counts.append(cum[offsets[1:]] - cum[offsets[:-1]])
    n_model = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    return {
        "finish_reasons": finish,
        "n_empty_responses": int((n_model == 0).sum()),
        "response_tokens_mean": float(n_model.mean()) if len(n_model) else None,
        "response_tokens_max": int(n_model.max()) if len(n_model) else None,
    }
