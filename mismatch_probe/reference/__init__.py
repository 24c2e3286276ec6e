"""The training-side reference: a Hugging Face forward that scores the engine's exact tokens, in one
process (``scorer``) or as torch.distributed ranks with tensor or Ulysses sequence parallelism
(``distributed``, ``parallel``). It writes the scored token shards; it never samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mismatch_probe.config.spec import ReferenceSpec


def open_reference_scorer(
    model_path: str | Path, spec: ReferenceSpec, *, trust_remote_code: bool = False, log_path: str | Path | None = None
):
    """A scorer for ``spec``'s layout: in this process, or over ``sp * tp`` rank processes (FSDP
    needs a process group, even of one rank)."""
    if spec.sequence_parallel_size * spec.tensor_parallel_size == 1 and not spec.fsdp:
        from mismatch_probe.reference.scorer import ReferenceScorer

        return ReferenceScorer(model_path, spec, trust_remote_code=trust_remote_code)
    from mismatch_probe.reference.distributed import DistributedReferenceScorer

    return DistributedReferenceScorer(model_path, spec, trust_remote_code=trust_remote_code, log_path=log_path)
