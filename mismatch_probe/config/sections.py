"""The spec's other tables: ``[sampling]``, ``[reference]``, ``[corrections]`` and ``[sync]``, and
:data:`SECTIONS`, every table by its key (``[engine]``: ``config/engine_spec.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    model_validator,
)

from mismatch_probe.config.choices import (
    CORRECTIONS,
    DTYPES,
    PERTURBED,
    REFERENCE,
    SAMPLING,
    SP_ATTN_IMPLEMENTATIONS,
    SYNC,
    AttnImplementation,
    Device,
    Dtype,
    EngineDtype,
    ReferenceLogprobs,
    SpecTable,
    SyncTransfer,
)
from mismatch_probe.config.engine_spec import EngineSpec
from mismatch_probe.config.settings import setting
from mismatch_probe.config.validation import (
    rule_error,
)


class SamplingSpec(SpecTable):
    temperature: float = setting(
        1.0, "Sampling temperature (0 = greedy).", flag="--temperature", affects="rollouts", group=SAMPLING, ge=0
    )
    top_p: float = setting(
        1.0, "Nucleus sampling mass.", flag="--top-p", affects="rollouts", group=SAMPLING, gt=0, le=1
    )
    top_k: int = setting(0, "Top-k (0 or -1 disables it).", flag="--top-k", affects="rollouts", group=SAMPLING, ge=-1)
    max_tokens: int = setting(
        256, "Maximum new tokens per response.", flag="--max-tokens", affects="rollouts", group=SAMPLING, ge=1
    )
    n: int = setting(1, "Samples per prompt.", flag="--n", affects="rollouts", group=SAMPLING, ge=1)
    seed: int = setting(
        0, "Sampling seed.", flag="--seed", affects="rollouts", group=SAMPLING, not_an_axis="the repeats vary the seed"
    )
    # adaptive sample size (pipeline/adaptive.py): the engine samples in rounds, each scored by the
    # reference as it comes, until K3's interval is as tight as asked or a budget is spent. They
    # decide how many samples exist, so they enter the rollout fingerprint; since=5: unset, they are
    # in no record or fingerprint, so every run recorded before them still resumes.
    precision: float | None = setting(
        None,
        "Sample in rounds until K3's 95% sequence-bootstrap interval is within this fraction of K3 "
        "(0.1: +-10%), or a budget is spent; the first round is the prompts x n samples.",
        flag="--precision",
        affects="rollouts",
        group=SAMPLING,
        since=5,
        not_an_axis="it decides how many samples a point draws, not how they are drawn",
        gt=0,
        lt=1,
    )
    max_samples: int | None = setting(
        None,
        "With --precision: the most samples all rounds may draw (default: 10x the prompts x n).",
        flag="--max-samples",
        affects="rollouts",
        group=SAMPLING,
        since=5,
        not_an_axis="a budget of --precision",
        ge=1,
    )
    token_budget: int | None = setting(
        None,
        "With --precision: the most model tokens all rounds may hold (a round is sized by this run's tokens per "
        "sample so far; default: no limit).",
        flag="--token-budget",
        affects="rollouts",
        group=SAMPLING,
        since=5,
        not_an_axis="a budget of --precision",
        ge=1,
    )
    time_budget: float | None = setting(
        None,
        "With --precision: the most seconds sampling and scoring all rounds may take (a round is sized by this "
        "run's seconds per sample so far; the engine's start and the reference's load not counted; default: no limit).",
        flag="--time-budget",
        affects="rollouts",
        group=SAMPLING,
        since=5,
        not_an_axis="a budget of --precision",
        gt=0,
    )

    @model_validator(mode="after")
    def _budget_of_precision(self) -> SamplingSpec:
        if self.precision is None:
            for key in ("max_samples", "token_budget", "time_budget"):
                if getattr(self, key) is not None:
                    raise rule_error(
                        f"sampling.{key} is a budget of the adaptive sample size, which sampling.precision turns on",
                        key=key,
                        hint="add --precision (e.g. 0.1), or drop the budget",
                    )
        return self


class ReferenceSpec(SpecTable):
    """The training side: a full-sequence forward as a trainer computes it."""

    dtype: Dtype = setting(
        "bfloat16", "Reference dtype.", flag="--train-dtype", affects="run", group=REFERENCE, choices=DTYPES
    )
    logits_fp32: bool = setting(
        False, "Reference LM head in float32.", flag="--logits-fp32/--no-logits-fp32", affects="run", group=REFERENCE
    )
    attn_implementation: AttnImplementation = setting(
        "auto",
        "Reference attention implementation (auto: sdpa where the architecture supports it, else eager).",
        flag="--train-attn",
        affects="run",
        group=REFERENCE,
    )
    packing: bool = setting(
        True,
        "Padding-free packing (sequences concatenated, position ids restarting per sequence) vs padded micro-batches.",
        flag="--packing/--no-packing",
        affects="run",
        group=REFERENCE,
    )
    micro_batch_size: int = setting(
        16, "Reference sequences per forward.", flag="--micro-batch-size", affects="run", group=REFERENCE, ge=1
    )
    max_tokens_per_micro_batch: int = setting(
        4096,
        "Packed mode: the token budget of one forward.",
        flag="--max-tokens-per-micro-batch",
        affects="run",
        group=REFERENCE,
        ge=1,
    )
    device: Device = setting("auto", "Reference device.", flag="--train-device", affects="run", group=REFERENCE)
    # training layouts (one process per rank, torch.distributed): Ulysses sequence parallelism
    # shards the packed row across ranks; tensor parallelism shards attention and MLP weights
    # (DTensor, the model's own column/row-wise plan). world size = sequence x tensor.
    sequence_parallel_size: int = setting(
        1,
        "Reference Ulysses sequence-parallel size (ranks share each packed row; needs --packing).",
        flag="--train-sp",
        affects="run",
        group=REFERENCE,
        ge=1,
    )
    tensor_parallel_size: int = setting(
        1,
        "Reference tensor-parallel size (DTensor column/row-wise plan).",
        flag="--train-tp",
        affects="run",
        group=REFERENCE,
        ge=1,
    )
    # FSDP2 (fully_shard) over the data- and sequence-parallel ranks with a MixedPrecisionPolicy,
    # so the forward runs an FSDP learner's numerics. The defaults are verl's FSDP2 actor's:
    # weights gathered and computed in bfloat16, gradients reduced in float32 (no effect on a
    # forward), outputs left as computed. ``dtype`` is then the master (sharded) weights' dtype.
    fsdp: bool = setting(
        False,
        "Wrap the reference with FSDP2 fully_shard and a mixed-precision policy (dtype: the master weights').",
        flag="--fsdp/--no-fsdp",
        affects="run",
        group=REFERENCE,
        since=4,
    )
    fsdp_param_dtype: Dtype = setting(
        "bfloat16",
        "FSDP2: the dtype weights are gathered and computed in.",
        flag="--fsdp-param-dtype",
        affects="run",
        group=REFERENCE,
        since=4,
        choices=DTYPES,
    )
    fsdp_reduce_dtype: Dtype = setting(
        "float32",
        "FSDP2: the dtype gradients are reduced in (no effect on a forward).",
        flag="--fsdp-reduce-dtype",
        affects="run",
        group=REFERENCE,
        since=4,
        choices=DTYPES,
    )
    fsdp_output_dtype: Dtype | None = setting(
        None,
        "FSDP2: the dtype of the forward's outputs (default: as computed).",
        flag="--fsdp-output-dtype",
        affects="run",
        group=REFERENCE,
        since=4,
        choices=DTYPES,
    )
    logprobs: ReferenceLogprobs = setting(
        "engine",
        "Reference distribution: engine (match it), raw, temperature (logits / T, as verl's actor), processed.",
        flag="--reference-logprobs",
        affects="run",
        group=REFERENCE,
    )
    # the routing replay (R3) what-if: a second reference forward of MoE runs whose engine recorded
    # its routing. since=5: at its default it is in no fingerprint, so earlier runs still resume.
    routing_replay: bool = setting(
        True,
        "MoE runs with the engine's routing: the reference scores the tokens a second time with the routing "
        "behind each model token forced to the engine's experts (R3), for the routing replay what-if.",
        flag="--routing-replay/--no-routing-replay",
        affects="run",
        group=REFERENCE,
        since=5,
    )

    @model_validator(mode="after")
    def _sequence_parallel(self) -> ReferenceSpec:
        if self.sequence_parallel_size > 1:
            if not self.packing:
                raise rule_error(
                    "Ulysses sequence parallelism (--train-sp) shards one packed row across ranks; "
                    "padded micro-batches have no packed row",
                    key="packing",
                    hint="use --packing (reference.packing = true)",
                )
            if self.attn_implementation not in (*SP_ATTN_IMPLEMENTATIONS, "auto"):
                raise rule_error(
                    f"reference.attn_implementation {self.attn_implementation!r} cannot run under sequence "
                    f"parallelism (it needs a mask over the whole row); choose {' or '.join(SP_ATTN_IMPLEMENTATIONS)}",
                    key="attn_implementation",
                )
        return self


class CorrectionThresholds(BaseModel):
    """Thresholds of the correction what-ifs; defaults follow verl's rollout correction.

    verl: ``rollout_is_threshold`` 2.0, RS lower bound the reciprocal of the upper one, geometric
    RS thresholds "typically 1.0002 - 1.001", token veto "typically 1e-4 to 1e-6".
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    token_tis: float = setting(
        2.0, "Token TIS: ratios clipped above this.", flag="--token-tis", affects="run", group=CORRECTIONS, gt=1
    )
    token_mask_low: float = setting(
        0.5,
        "Token masking: tokens with a ratio below this are dropped.",
        flag="--token-mask-low",
        affects="run",
        group=CORRECTIONS,
        gt=0,
        lt=1,
    )
    token_mask_high: float = setting(
        2.0,
        "Token masking: tokens with a ratio above this are dropped.",
        flag="--token-mask-high",
        affects="run",
        group=CORRECTIONS,
        gt=1,
    )
    seq_tis: float = setting(
        2.0,
        "Sequence TIS: sequence ratios clipped above this.",
        flag="--seq-tis",
        affects="run",
        group=CORRECTIONS,
        gt=1,
    )
    seq_mis: float = setting(
        2.0,
        "Sequence masking: sequences with a ratio above this are dropped.",
        flag="--seq-mis",
        affects="run",
        group=CORRECTIONS,
        gt=1,
    )
    geo_eps: float = setting(
        1e-3,
        "Geometric rejection: sequences whose geometric-mean ratio is outside 1 ± this are dropped.",
        flag="--geo-eps",
        affects="run",
        group=CORRECTIONS,
        gt=0,
        lt=1,
    )
    worst_token_tau: float = setting(
        1e-4,
        "Token veto: sequences holding a token ratio below this are dropped.",
        flag="--worst-token-tau",
        affects="run",
        group=CORRECTIONS,
        gt=0,
        lt=1,
    )

    def as_record(self) -> dict[str, Any]:
        """The thresholds as they appear in run.json, next to the share each one produces."""
        return {
            "token_tis_clipped_share": {"ratio_above": self.token_tis},
            "token_mask_share": {"ratio_below": self.token_mask_low, "ratio_above": self.token_mask_high},
            "seq_tis_clipped_share": {"seq_ratio_above": self.seq_tis},
            "seq_mis_masked_share": {"seq_ratio_above": self.seq_mis},
            "geo_rejected_share": {"geo_ratio_below": 1.0 - self.geo_eps, "geo_ratio_above": 1.0 + self.geo_eps},
            "worst_token_rejected_share": {"min_token_ratio_below": self.worst_token_tau},
        }


class SyncSpec(SpecTable):
    """[sync]: the engine starts from another checkpoint and then receives the probe's model through
    its own weight-update path before it samples, as an RL engine does after every optimizer step
    (ARCHITECTURE.md, Weight sync). Off while ``start_from`` is unset; a spec without it records and
    fingerprints as before [sync] existed."""

    start_from: str | None = setting(
        None,
        "The checkpoint the engine starts from before the sync: a directory, or 'perturbed' (the model "
        "with small deterministic noise, made by the probe). Unset: no sync.",
        flag="--sync-from",
        affects="rollouts",
        group=SYNC,
        path=True,
        choices=(PERTURBED,),
        since=4,
    )
    transfer: SyncTransfer = setting(
        "tensor",
        "How the weights travel: tensors through the engine's RPC, a checkpoint on disk, or NCCL (GPUs).",
        flag="--sync-transfer",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    dtype: EngineDtype = setting(
        "auto",
        "The dtype the trainer sends the weights in (auto: the checkpoint's).",
        flag="--sync-dtype",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    bucket_mb: float = setting(
        512.0,
        "Weights per transfer, in MiB (ms-swift's move_model_batches, verl's bucketed transfer).",
        flag="--sync-bucket-mb",
        affects="rollouts",
        group=SYNC,
        since=4,
        gt=0,
    )
    reset_prefix_cache: bool = setting(
        True,
        "Reset the engine's prefix cache after the sync.",
        flag="--sync-reset-prefix-cache/--no-sync-reset-prefix-cache",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    repeats: int = setting(
        1,
        "Sync the same weights this many times, sampling after each.",
        flag="--sync-repeats",
        affects="rollouts",
        group=SYNC,
        since=4,
        ge=1,
        le=100,
    )
    warm_cache: bool = setting(
        False,
        "Sample the prompts before the sync, so the prefix cache holds entries of the old weights.",
        flag="--sync-warm-cache/--no-sync-warm-cache",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    sleep_level: int = setting(
        0,
        "Colocate cycle before the sync: the engine sleeps at this level (1 or 2), then wakes (0: none).",
        flag="--sync-sleep-level",
        affects="rollouts",
        group=SYNC,
        since=4,
        ge=0,
        le=2,
    )

    @property
    def enabled(self) -> bool:
        return self.start_from is not None

    @model_validator(mode="after")
    def _needs_start(self) -> SyncSpec:
        if self.start_from is None:
            changed = [k for k, f in type(self).model_fields.items() if getattr(self, k) != f.default]
            if changed:
                raise rule_error(
                    f"sync.{changed[0]} is set but sync.start_from is not: nothing is synced",
                    key=changed[0],
                    hint="set start_from = 'perturbed' (or a checkpoint directory) in [sync], or --sync-from",
                )
        return self


# the setting tables, by their key in the spec
SECTIONS: dict[str, type[BaseModel]] = {
    "engine": EngineSpec,
    "sampling": SamplingSpec,
    "reference": ReferenceSpec,
    "corrections": CorrectionThresholds,
    "sync": SyncSpec,
}
# the tables a [[variants]] entry may change: those that score the same rollouts
VARIANT_SECTIONS = ("reference", "corrections")
