"""The probe's side of an SGLang weight sync that runs inside SGLang's scheduler processes, next to the
model (ARCHITECTURE.md, Weight sync).

SGLang runs a custom weight loader ``f(model, named_tensors)`` in every scheduler process when
``update_weights_from_tensor`` names it as its ``load_format`` and the server was started with it
in ``custom_weight_loader`` (srt/model_executor/model_runner_components/weight_updater.py:
``WeightUpdater.update_weights_from_tensor``). The adapter (``engines/sglang.py``) sends one control
tensor under :data:`CONTROL_NAME`, a uint8 tensor of UTF-8 JSON, ``{"op": ..., "out": path}``;
SGLang ignores what a loader returns, so :func:`probe_loader` writes its answer to ``out`` (tensor
parallel rank 0 only, and only once per call: a speculative draft runner, which SGLang calls after
the target, does not overwrite the target's answer).

Imported by SGLang's scheduler processes: keep it light (no SGLang import at module level).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np

from mismatch_probe.engines.weight_sync import module_digest

# the import path SGLang's dynamic_import resolves ("module.function")
LOADER = "mismatch_probe.engines.sglang_sync.probe_loader"
CONTROL_NAME = "mismatch_probe.control"
# where the untie fault keeps the tied head module, to tie it again on the next sync
TIED_HEAD_ATTR = "_mismatch_probe_tied_lm_head"


def control_tensors(op: str, out: str | Path) -> list[tuple[str, object]]:
    """The named tensors of one control call (for ``update_weights_from_tensor``)."""
    import torch

    payload = json.dumps({"op": op, "out": str(out)}).encode()
    return [(CONTROL_NAME, torch.frombuffer(bytearray(payload), dtype=torch.uint8))]


def _rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # an SGLang without the runtime context, or none at all (unit tests)
        return 0


def probe_loader(model, named_tensors) -> None:
    """SGLang's custom weight loader for the probe's control calls (never for weights)."""
    control = [t for name, t in named_tensors if name == CONTROL_NAME]
    if len(control) != 1 or len(named_tensors) != 1:
        names = [name for name, _ in named_tensors][:5]
        raise ValueError(f"{LOADER} takes one {CONTROL_NAME} tensor, got {names}")
    request = json.loads(bytes(control[0].cpu().numpy().tobytes()).decode())
    out = Path(request["out"])
    # SGLang does not catch what a custom loader raises: the scheduler process would die of it, so an
    # error is an answer of its own (``<out>.error``), raised by the adapter
    try:
        answer = run(model, request["op"])
    except Exception as exc:  # passed on whole to the adapter
        answer, out = f"{type(exc).__name__}: {exc}", error_path(out)
    if _rank() != 0 or out.exists():
        return
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if isinstance(answer, str):
        tmp.write_text(answer)
    elif request["op"] == "digest":
        with open(tmp, "wb") as f:
            np.savez(f, **answer)
    else:
        tmp.write_text(json.dumps(answer))
    tmp.replace(out)


def error_path(out: str | Path) -> Path:
    return Path(f"{out}.error")


def run(model, op: str):
    if op == "digest":
        return module_digest(model)
    if op == "untie_lm_head":
        return untie_lm_head(model)
    if op == "retie_lm_head":
        return retie_lm_head(model)
    raise ValueError(f"unknown probe control op {op!r}")


def untie_lm_head(model) -> dict:
    """Test-only fault: the LM head becomes a module of its own (a deep copy of the head as it is
    now), so that an update of the embedding alone would not reach it. The tied module is kept, so
    that the next sync ties it again (:func:`retie_lm_head`)."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None:
        return {"untied": False, "why": "the model has no lm_head"}
    if head is not embed:
        return {
            "untied": False,
            "why": "the LM head is not tied to the embedding (model.lm_head is not model.model.embed_tokens)",
        }
    model.__dict__[TIED_HEAD_ATTR] = head  # not a registered submodule: no parameters of its own
    model.lm_head = own_copy(head)
    return {"untied": True}


def own_copy(module):
    """``module`` with parameters of its own (clones, keeping SGLang's attributes on them: weight_loader,
    ...), sharing everything else. Not ``copy.deepcopy``: SGLang's parallel layers hold their process
    group, which cannot be copied ("cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object")."""
    import torch

    new = copy.copy(module)
    new._parameters = {}
    for name, p in module._parameters.items():
        if p is None:
            new._parameters[name] = None
            continue
        q = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        q.__dict__.update(p.__dict__)
        new._parameters[name] = q
    new._buffers = dict(module._buffers)
    new._modules = {name: own_copy(m) if m is not None else None for name, m in module._modules.items()}
    return new


def retie_lm_head(model) -> dict:
    """Undo :func:`untie_lm_head`: the LM head is the embedding module again."""
    tied = model.__dict__.pop(TIED_HEAD_ATTR, None)
    if tied is None:
        return {"retied": False}
    model.lm_head = tied
    return {"retied": True}
