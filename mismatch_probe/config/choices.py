"""The spec's vocabularies: the values a setting chooses from (dtypes, attention implementations,
log-prob modes, remote dialects), each engine's default log-prob mode, the CLI's help panels, and the
base of every spec table. Declarations: ``config/engine_spec.py``, ``config/sections.py``; the spec
as a whole: ``config/spec.py``."""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
)

from mismatch_probe.config.remote_dialects import REMOTE_DIALECTS

# ---- choices ----------------------------------------------------------------------------------

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
Dtype = Literal["float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"]
EngineDtype = Literal["auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"]
DTYPES = ("float32", "bfloat16", "float16")  # what messages list (the aliases are accepted too)
assert set(typing.get_args(Dtype)) == set(DTYPE_ALIASES) and set(typing.get_args(EngineDtype)) == {
    "auto",
    *DTYPE_ALIASES,
}

# auto: sdpa where the architecture supports it, else eager (modeling/loading.py: choose_attention)
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
ATTN_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(AttnImplementation)
# attention that runs under Ulysses sequence parallelism: per packed sequence from cu_seq_lens (sdpa,
# flash), or eager with a mask over the whole packed row (reference/parallel.py: packed_row_mask)
SP_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
Device = Literal["auto", "cpu", "cuda"]
# What an engine's log-probs are taken from: the raw logits, or after temperature/top-k/top-p.
LogprobsMode = Literal["raw", "processed"]
LOGPROBS_MODES: tuple[str, ...] = typing.get_args(LogprobsMode)
# which distribution the reference scores under: "engine" (the same as the engine's log-probs, the
# only comparable choice), or deliberately "raw", "temperature" (logits / T only, as verl's actor
# does), "processed" (temperature, top-k, top-p)
ReferenceLogprobs = Literal["engine", "raw", "temperature", "processed"]
ExecutorBackend = Literal["mp", "ray", "uni", "external_launcher"]  # vLLM 0.32's ParallelConfig choices
# the remote engine's dialects (config/remote_dialects.py): a Literal of their names, built from the list
if TYPE_CHECKING:
    RemoteApi = str
else:
    RemoteApi = Literal[tuple(REMOTE_DIALECTS)]
# what each engine returns when nobody asks (raw where not named): SGLang's sampler gives
# log_softmax(logits / T); a remote engine ("remote-<api>") what its dialect's line says
# (config/remote_dialects.py). The one place it is written: spec normalization and the adapters
# read it (default_logprobs_mode).
ENGINE_DEFAULT_LOGPROBS_MODE: dict[str, LogprobsMode] = {
    "sglang": "processed",
    **{f"remote-{api}": d.logprobs_mode for api, d in REMOTE_DIALECTS.items() if d.logprobs_mode != "raw"},
}


def default_logprobs_mode(engine: str, api: str | None = None) -> LogprobsMode:
    """The log-probs ``engine`` returns when ``engine.logprobs_mode`` is unset (a remote engine's: its API's)."""
    return ENGINE_DEFAULT_LOGPROBS_MODE.get(f"{engine}-{api}" if api else engine, "raw")


# help panels of the CLI
INPUTS, ENGINE, LAYOUT, REMOTE, SAMPLING, REFERENCE, CORRECTIONS, SYNC = (
    "Inputs",
    "Engine",
    "Engine layout (multi-GPU, multi-node)",
    "Remote engine (a running server)",
    "Sampling",
    "Reference (the training-side forward)",
    "Correction what-ifs",
    "Weight sync (the trainer's update path)",
)
# How the trainer's weights reach the engine: through the engine's RPC as tensors, through a
# checkpoint on disk, or over a process group (NCCL; GPUs only)
SyncTransfer = Literal["tensor", "disk", "nccl"]
# the start checkpoint the probe makes itself: the model with small deterministic noise
PERTURBED = "perturbed"


class SpecTable(BaseModel):
    """A table of the spec: unknown keys are errors, values are checked strictly (no ``"2"`` for an
    integer, no ``"yes"`` for a boolean; an integer is fine for a number), also on assignment."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
