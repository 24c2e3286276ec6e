"""The sampling distribution, written once for both sides.

An engine's *processed* log-probs are log-probs of the distribution it actually samples from
(temperature, then top-k, then top-p: the order of vLLM's sampler); *raw* log-probs are
log_softmax of the unmodified logits. The reference must score under the same transformation
as the engine side it is compared with, so both use :func:`processed_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mismatch_probe.config.spec import LOGPROBS_MODES

if TYPE_CHECKING:  # torch is imported where the tensors are, so spec/report/gate stay light
    import torch


@dataclass(frozen=True)
class LogprobSemantics:
    """What distribution a log-prob is taken from (recorded in run.json for both sides)."""

    mode: str  # "raw" or "processed"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs mode must be one of {LOGPROBS_MODES}, got {self.mode!r}")

    @property
    def transforms_logits(self) -> bool:
        return (
            self.mode == "processed"
            and self.temperature > 0
            and (self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0)
        )

    def distribution(self) -> tuple:
        """What identifies the distribution: two semantics with equal keys give equal log-probs."""
        if not self.transforms_logits:
            return ("raw",)
        return ("processed", self.temperature, self.top_k, self.top_p)

    @classmethod
    def from_record(cls, d: dict) -> LogprobSemantics:
        return cls(d["mode"], d.get("temperature", 1.0), d.get("top_k", 0), d.get("top_p", 1.0))

    def describe(self) -> dict:
        d = {"mode": self.mode}
        if self.mode == "processed":
            d.update(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            steps = "logits / temperature"
            if self.top_k > 0:
                steps = f"top_k({steps})"
            if self.top_p < 1.0:
                steps = f"top_p({steps})"
            d["distribution"] = f"log_softmax({steps})"
        else:
            d["distribution"] = "log_softmax(logits)"
        return d


def engine_semantics(logprobs_mode: str, temperature: float, top_k: int, top_p: float) -> LogprobSemantics:
    """What an engine's ``raw``/``processed`` log-probs describe under these sampling settings
    (greedy decoding has no processed distribution: the log-probs are raw)."""
    return LogprobSemantics(logprobs_mode if temperature > 0 else "raw", temperature, top_k, top_p)


def reference_semantics(
    choice: str, engine: LogprobSemantics, temperature: float, top_k: int, top_p: float
) -> LogprobSemantics:
    """The reference's distribution for ``reference.logprobs``: "engine" matches the engine;
    "raw", "temperature" (logits / T, what verl's actor scores) and "processed" (T, top-k, top-p)
    are deliberate choices, for measuring what a mismatched trainer would see."""
    if choice == "engine":
        return engine
    if choice == "raw" or temperature <= 0:
        return LogprobSemantics("raw")
    if choice == "temperature":
        return LogprobSemantics("processed", temperature, 0, 1.0)
    if choice == "processed":
        return LogprobSemantics("processed", temperature, top_k, top_p)
    raise ValueError(f"unknown reference log-probs {choice!r}")


def processed_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p; filtered entries become -inf.

    Mirrors vLLM's ``apply_top_k_top_p`` (ascending sort; a token is dropped when the mass of all
    tokens up to and including it in ascending order is <= 1 - top_p; the most likely token is
    always kept), so boundary cases resolve the same way on both sides. ``temperature <= 0`` means
    greedy: the logits are returned unscaled.
    """
    import torch

    out = logits.float()
    if temperature > 0 and temperature != 1.0:
        out = out / temperature
    vocab = out.shape[-1]
    use_k = 0 < top_k < vocab
    use_p = top_p < 1.0
    if not (use_k or use_p):
        return out
    sorted_logits, order = out.sort(dim=-1, descending=False)
    if use_k:
        kth = sorted_logits[..., vocab - top_k : vocab - top_k + 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_p:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[..., -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(sorted_logits).scatter_(-1, order, sorted_logits)


def logprobs_under(logits: torch.Tensor, semantics: LogprobSemantics) -> torch.Tensor:
    """Log-probs (float32) of the distribution ``semantics`` names, over the last dimension."""
    import torch

    if semantics.transforms_logits:
        logits = processed_logits(logits, semantics.temperature, semantics.top_k, semantics.top_p)
    return torch.log_softmax(logits.float(), dim=-1)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats); filtered (-inf) entries contribute 0, not NaN."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)
