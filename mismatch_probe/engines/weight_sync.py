"""The trainer's half of a weight sync, engine-agnostic (ARCHITECTURE.md, Weight sync).

An RL trainer pushes its weights to the engine after every optimizer step: it walks its state dict
in the checkpoint's names, casts each tensor to the dtype it sends in, groups them into buckets of
a fixed size (verl's bucketed transfer, ms-swift's ``move_model_batches``) and hands each bucket to
the engine's update call, which re-shards and re-fuses them (q/k/v, gate/up, the experts) into its
own layout. Here the trainer's weights are the probe's checkpoint, read tensor by tensor from its
safetensors files; each engine adapter takes the buckets through its own update path
(``sync_weights``) and reports what it updated.

Also here, because the engine's worker process runs them: the probe's own start checkpoint
(``perturbed``: the model with small deterministic noise), the disk transfer's checkpoint, and the
digest of an engine's parameters that names what a sync got wrong (``analysis/sync.py``).

Fault injection, for tests only: ``MISMATCH_PROBE_SYNC_FAULT`` names one fault of :data:`FAULTS`
that the trainer's side then commits on purpose, so the tests can show each is caught and named.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from mismatch_probe.engines.base import batch_seed
from mismatch_probe.files import atomic_path

# the test-only hook: which fault the trainer's side commits (unset in every real run)
FAULT_ENV = "MISMATCH_PROBE_SYNC_FAULT"
FAULTS = {
    "skip": "one parameter is not sent (the first MLP down projection)",
    "float16": "one parameter is sent through float16 (the embedding)",
    "swap_gate_up": "the first layer's gate and up projections are sent under each other's names",
    "swap_kv": "the first layer's k and v projections are sent under each other's names",
    "untie_lm_head": "the engine's LM head is made a tensor of its own before the sync, no longer tied to the embedding",
    "permute_experts": "the first MoE layer's experts 0 and 1 are sent under each other's names",
}
# the noise of the perturbed start checkpoint, relative to each tensor's RMS
PERTURB_SCALE = 0.05
TRAINER_CHECKPOINT = "model.safetensors"
# files besides the weights that make a directory a checkpoint the engines load
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def fault_from_env() -> str | None:
    fault = os.environ.get(FAULT_ENV) or None
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r} is not one of {', '.join(FAULTS)}")
    return fault


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """Every tensor of a safetensors checkpoint, by its checkpoint name, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                yield name, f.get_tensor(name)


def _first(names: Iterable[str], pattern: str) -> str | None:
    rx = re.compile(pattern)
    return next((n for n in names if rx.search(n)), None)


def _swap_pairs(names: list[str], fault: str) -> dict[str, str]:
    """The names a swapping fault sends under each other's: {name: name it is sent as}."""
    patterns = {
        "swap_gate_up": (r"layers\.0\..*gate_proj\.weight$", "gate_proj", "up_proj"),
        "swap_kv": (r"layers\.0\..*k_proj\.weight$", "k_proj", "v_proj"),
        "permute_experts": (r"layers\.\d+\..*experts\.0\.", "experts.0.", "experts.1."),
    }
    pattern, a, b = patterns[fault]
    first = _first(names, pattern)
    if first is None:
        raise ValueError(f"fault {fault}: the checkpoint has no tensor matching {pattern}")
    layer = first.split(a)[0]
    pairs = {}
    for n in names:
        if n.startswith(layer) and a in n and n.replace(a, b) in names:
            pairs[n], pairs[n.replace(a, b)] = n.replace(a, b), n
    return pairs


def trainer_tensors(model_dir: str | Path, dtype: str | None, fault: str | None = None) -> Iterator[tuple[str, object]]:
    """The trainer's weights as it sends them: the checkpoint's tensors in ``dtype`` (None: as
    stored), with ``fault`` committed when one is named (tests only)."""
    import torch

    send = None if dtype in (None, "auto") else getattr(torch, dtype)
    names = checkpoint_names(model_dir)
    skip = _first(names, r"down_proj\.weight$") if fault == "skip" else None
    through_fp16 = _first(names, r"embed_tokens\.weight$") if fault == "float16" else None
    renamed = _swap_pairs(names, fault) if fault in ("swap_gate_up", "swap_kv", "permute_experts") else {}
    for name, tensor in checkpoint_tensors(model_dir):
        if name == skip:
            continue
        if name == through_fp16:
            tensor = tensor.to(torch.float16).to(tensor.dtype)
        if send is not None and tensor.is_floating_point():
            tensor = tensor.to(send)
        yield renamed.get(name, name), tensor


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """The checkpoint's tensor names, in :func:`checkpoint_tensors`' order, no tensor read."""
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(named: Iterable[tuple[str, object]], bucket_bytes: int) -> Iterator[list[tuple[str, object]]]:
    """Group named tensors into buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, object]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class SentBuckets:
    """The trainer's buckets (:func:`buckets` of ``bucket_mb`` MiB) as an adapter sends them, counted
    for its report: ``counts()`` is the ``buckets``, ``tensors`` and ``bytes`` sent so far."""

    def __init__(self, named: Iterable[tuple[str, object]], bucket_mb: float):
        self._buckets = buckets(named, int(bucket_mb * 2**20))
        self.buckets = self.tensors = self.bytes = 0

    def __iter__(self) -> Iterator[list[tuple[str, object]]]:
        for bucket in self._buckets:
            self.buckets += 1
            self.tensors += len(bucket)
            self.bytes += sum(tensor_bytes(t) for _, t in bucket)
            yield bucket

    def counts(self) -> dict:
        return {"buckets": self.buckets, "tensors": self.tensors, "bytes": self.bytes}


def write_checkpoint(named: Iterable[tuple[str, object]], out_dir: str | Path, model_dir: str | Path) -> dict:
    """The disk transfer's checkpoint: the trainer's tensors as one safetensors file beside the
    model's config and tokenizer, written under a temporary name and renamed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in named}  # type: ignore[attr-defined]
    with atomic_path(out / TRAINER_CHECKPOINT) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    for name in CONFIG_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, out / name)
    return {"tensors": len(tensors), "bytes": sum(tensor_bytes(t) for t in tensors.values())}


def perturbed_checkpoint(
    model_dir: str | Path, out_dir: str | Path, *, scale: float = PERTURB_SCALE, seed: int = 0
) -> Path:
    """The model with deterministic noise: each floating tensor ``w + scale * rms(w) * N(0, 1)``
    (one generator per tensor name, so the result does not depend on the file layout), in its own
    dtype, with the model's config and tokenizer beside it. Built once: an existing complete
    directory (its ``perturbation.json`` written last) is reused."""
    import torch

    out = Path(out_dir)
    stamp = out / "perturbation.json"
    recipe = {"source": str(Path(model_dir).resolve()), "scale": scale, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return out

    def noisy() -> Iterator[tuple[str, object]]:
        for name, tensor in checkpoint_tensors(model_dir):
            if tensor.is_floating_point():
                w = tensor.to(torch.float32)
                rms = float(w.square().mean().sqrt()) or 1.0
                g = torch.Generator().manual_seed(batch_seed(seed, name))
                w = w + scale * rms * torch.randn(w.shape, generator=g)
                tensor = w.to(tensor.dtype)
            yield name, tensor

    write_checkpoint(noisy(), out, model_dir)
    stamp.write_text(json.dumps(recipe))
    return out


def module_digest(module, effective=None) -> dict[str, np.ndarray]:
    """Each floating parameter of an engine's model as ``[rows, 2]`` float64: every row's sum and
    sum of squares over its last dimension (rows: all other dimensions flattened, so a fused
    q/k/v or gate/up weight and an experts tensor keep each row apart). Enough to tell a parameter
    that was not updated, one updated with rounding, and one whose rows or experts arrived in
    another order (``analysis/sync.py: weight_findings``). ``effective(module_name, module, name,
    param)`` may return the tensor a kernel really applies where the parameter is an empty
    placeholder (vLLM's CPU kernels keep linear weights repacked, out of the parameter)."""
    import torch

    out: dict[str, np.ndarray] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for module_name, sub in module.named_modules(remove_duplicate=False):
            for leaf, p in sub.named_parameters(recurse=False):
                if id(p) in seen or not p.is_floating_point():
                    continue
                seen.add(id(p))
                if p.numel() == 0 and effective is not None:
                    p = effective(module_name, sub, leaf, p)
                if p is None or p.numel() == 0:
                    continue
                out[f"{module_name}.{leaf}" if module_name else leaf] = tensor_digest(p)
    return out


def tensor_digest(p) -> np.ndarray:
    """One tensor's ``[rows, (sum, sum of squares)]`` over its last dimension, in float64."""
    import torch

    with torch.no_grad():
        # a vector's rows are its elements, so a fused bias whose shards swapped shows too
        rows = p.detach().to(torch.float64).reshape(-1, p.shape[-1] if p.dim() > 1 else 1)
        return torch.stack([rows.sum(-1), rows.square().sum(-1)], -1).cpu().numpy()


def pack_bucket(bucket: list[tuple[str, object]]) -> list[tuple[str, str, list[int], bytes]]:
    """A bucket as plain values (name, dtype, shape, raw bytes) for an RPC that carries bytes
    but not tensors (vLLM's ``collective_rpc`` over its message queue); :func:`unpack_bucket` undoes it."""
    import torch

    return [
        (name, str(t.dtype).removeprefix("torch."), list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())  # type: ignore[attr-defined]
        for name, t in bucket
    ]


def unpack_bucket(packed) -> list[tuple[str, object]]:
    import torch

    return [
        (name, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, data in packed
    ]
