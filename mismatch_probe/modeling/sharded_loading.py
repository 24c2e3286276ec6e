"""Sharded loading of a Hugging Face causal LM: each rank reads only its own shard of the weights.

``from_pretrained`` on every rank of a training layout holds the whole model in every process
before it is cut up, so the per-rank peak memory does not fall with the number of ranks. Here a
rank instead

1. builds the model with every *parameter* on the meta device (:func:`build_on_meta`; buffers such
   as the rotary ``inv_freq`` are computed for real, as the model's ``__init__`` computes them),
2. lets the caller lay it out: tensor parallelism (``parallelize_module``) and/or FSDP2
   (``fully_shard``), which turn parameters into DTensors on the meta device,
3. materializes its parameters on its device and fills each with *its own slice* of the checkpoint,
   read straight from the safetensors files (:func:`load_local_shards`).

The checkpoint's tensors must map one to one onto the model's parameters, by the names
``from_pretrained`` would map them to (transformers' own key renames and ``base_model_prefix``
handling). Where transformers would do more at load time (fuse or split tensors, as for some MoE
checkpoints; quantize; initialize a parameter the checkpoint lacks; untie tied weights the checkpoint
stores twice), :func:`check_loadable` raises :class:`NeedsFullLoad` before anything is materialized,
and the caller falls back to ``from_pretrained``. A DTensor placement this module cannot map to an
exact slice (anything but ``Shard``, ``Replicate`` and FSDP-over-TP's ``_StridedShard``) does the same.

Each tensor is read through ``safe_open(...).get_slice(name)[slices]``, which on CPU returns a view
of the memory-mapped file, copied (and cast) straight into the parameter's local storage. The file
is opened anew for each tensor, so the pages of the mapping a rank touched are unmapped after each
tensor and never add up in its resident memory.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

METHOD = "meta device + per-rank safetensors slices"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtypes a floating-point parameter may be loaded from (anything else is quantized data)
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# module wrappers that insert a level into parameter names (activation checkpointing, torch.compile)
WRAPPER_LEVELS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_TRANSFORMS_ATTR = "_mismatch_probe_weight_transforms"


class NeedsFullLoad(Exception):
    """The checkpoint cannot be loaded slice by slice into this model (the message says which tensor
    or parameter, and why); load it with ``from_pretrained`` instead. Raised before anything is
    materialized."""


# ---- building on the meta device -----------------------------------------------------------


@contextmanager
def _parameters_on_meta():
    """Every parameter a module registers goes to the meta device as it is registered; buffers stay
    where they are computed. A parameter already on the meta device is kept as is (the same object),
    so that weights tied during construction stay tied."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        param = module._parameters.get(name)
        if param is not None and param.device.type != "meta":
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _torch_dtype(dtype: str | torch.dtype, model_path: Path) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from mismatch_probe.modeling.loading import checkpoint_dtype

        dtype = checkpoint_dtype(model_path)
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _glob_regex(globs) -> re.Pattern:
    """transformers' ``build_glob_alternation`` for plain globs: ``*`` matches anything, searched."""
    return re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in globs))


def _keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the parameters (and floating persistent buffers) that ``from_pretrained`` would load in
    float32 (``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict``) that dtype here too."""
    dtype_plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not dtype_plan:
        return
    by_dtype: dict[torch.dtype, list[str]] = {}
    for glob, target in dtype_plan.items():
        by_dtype.setdefault(target, []).append(glob)
    for target, globs in by_dtype.items():
        pattern = _glob_regex(globs)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if pattern.search(name) and param.dtype != target:
                    param.data = param.data.to(target)  # the same Parameter object: ties hold
            for module_name, module in model.named_modules():
                for name, buf in list(module._buffers.items()):
                    fqn = f"{module_name}.{name}" if module_name else name
                    if (
                        buf is not None
                        and buf.is_floating_point()
                        and name not in module._non_persistent_buffers_set
                        and pattern.search(fqn)
                    ):
                        module._buffers[name] = buf.to(target)


def build_on_meta(
    model_path: Path, *, dtype: str, attn_implementation: str, trust_remote_code: bool
) -> torch.nn.Module:
    """The checkpoint's causal LM as ``AutoModelForCausalLM.from_config`` builds it, in eval mode,
    with every parameter on the meta device and the buffers real (non-persistent ones such as the
    rotary ``inv_freq`` keep the values ``__init__`` computed). Weights are tied as
    ``from_pretrained`` ties them, and parameters ``from_pretrained`` keeps in float32 are float32.
    Nothing is read from the weight files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_path = Path(model_path)
    torch_dtype = _torch_dtype(dtype, model_path)
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    stray = [name for name, p in model.named_parameters() if p.device.type != "meta"]
    if stray:  # registered around register_parameter (e.g. straight into _parameters)
        with torch.no_grad():
            for name in stray:
                param = model.get_parameter(name)
                param.data = torch.empty_like(param, device="meta")
    _keep_in_fp32(model, torch_dtype)
    # the checkpoint-key renames transformers applies for this class, looked up now: once the
    # model is laid out with FSDP2 its class name changes (FSDP<name>), and lookups by class miss
    setattr(model, _TRANSFORMS_ATTR, _weight_transforms(model))
    return model.eval()


# ---- the checkpoint ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a safetensors file, from its header."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _read_header(path: Path) -> dict[str, _Tensor]:
    """The tensors a safetensors file declares (its JSON header; no data is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[key] = _Tensor(key, path, info["dtype"], tuple(info["shape"]), end - begin)
    return out


def _weight_files(model_path: Path, explicit: str | None = None) -> list[Path]:
    """The safetensors files ``from_pretrained`` would read, in its order of preference: the file
    config.json names (``transformers_weights``), else ``model.safetensors``, else the files the index
    names."""
    if explicit:
        if not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise NeedsFullLoad(f"config.json names weights {explicit!r}, not safetensors")
        chosen = model_path / explicit
    elif (model_path / SINGLE_FILE).is_file():
        chosen = model_path / SINGLE_FILE
    elif (model_path / INDEX_FILE).is_file():
        chosen = model_path / INDEX_FILE
    else:
        raise NeedsFullLoad(f"{model_path} has neither {SINGLE_FILE} nor {INDEX_FILE} (safetensors weights)")
    if chosen.name.endswith(".index.json"):
        weight_map = json.loads(chosen.read_text()).get("weight_map") or {}
        return [chosen.parent / name for name in sorted(set(weight_map.values()))]
    return [chosen]


def _read_checkpoint(model_path: Path, explicit: str | None = None) -> dict[str, _Tensor]:
    tensors: dict[str, _Tensor] = {}
    for path in _weight_files(model_path, explicit):
        for key, tensor in _read_header(path).items():
            if key in tensors:
                raise NeedsFullLoad(f"checkpoint tensor {key!r} is in both {tensors[key].file.name} and {path.name}")
            tensors[key] = tensor
    return tensors


# ---- checkpoint names -> model names, as from_pretrained maps them ----------------------------


def _weight_transforms(model: torch.nn.Module) -> list:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4.x: no conversion mapping; names are matched as they are
        return []
    return list(get_model_conversion_mapping(model))


def _canonical(name: str) -> str:
    """A parameter's name without the levels module wrappers add (the name in a checkpoint)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_LEVELS)


def _persistent_buffers(model: torch.nn.Module) -> dict[str, str]:
    """Canonical name -> name of every persistent buffer (those a state dict, and a checkpoint, holds)."""
    out = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                fqn = f"{module_name}.{name}" if module_name else name
                out.setdefault(_canonical(fqn), fqn)
    return out


def _key_mapper(model: torch.nn.Module, expected: set[str]):
    """A function: checkpoint key -> (model key, the pattern of the transformers weight *converter*
    that matched it or None), as ``convert_and_load_state_dict_in_model`` renames keys: all of the
    model's ``WeightRenaming``s, then at most one ``WeightConverter``, then ``base_model_prefix`` added
    or removed as the model's keys need."""
    import copy

    prefix = getattr(model, "base_model_prefix", "") or None
    meta = dict.fromkeys(expected, True)
    try:
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x: names as they are, base_model_prefix added or removed

        def by_prefix(key: str) -> tuple[str, str | None]:
            if prefix and key not in meta:
                if key.startswith(f"{prefix}.") and key[len(prefix) + 1 :] in meta:
                    return key[len(prefix) + 1 :], None
                if f"{prefix}.{key}" in meta:
                    return f"{prefix}.{key}", None
            return key, None

        return by_prefix

    transforms = getattr(model, _TRANSFORMS_ATTR, None)
    if transforms is None:
        transforms = _weight_transforms(model)
    transforms = copy.deepcopy(transforms)  # renaming marks them used
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def mapper(key: str) -> tuple[str, str | None]:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers: the key needed no renaming after all
            renamed, pattern = rename_source_key(key, [], [], prefix, meta)
        return renamed, pattern

    return mapper


@dataclass
class _Plan:
    params: list[tuple[str, _Tensor]] = field(default_factory=list)  # (model name, its checkpoint tensor)
    buffers: list[tuple[str, _Tensor]] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)  # checkpoint tensors no parameter takes (ignored, as there)


def _plan(model: torch.nn.Module, model_path: Path) -> _Plan:
    model_path = Path(model_path)
    config = getattr(model, "config", None)
    if getattr(config, "quantization_config", None):
        raise NeedsFullLoad("the checkpoint is quantized (config.quantization_config): transformers converts it")
    if getattr(model, "hf_quantizer", None) is not None:
        raise NeedsFullLoad("the model is quantized")
    checkpoint = _read_checkpoint(model_path, getattr(config, "transformers_weights", None))

    groups: dict[int, list[str]] = {}  # one entry per parameter object: its names (more than one if tied)
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    names = {_canonical(n): n for group in groups.values() for n in group}
    buffers = _persistent_buffers(model)
    expected = set(names) | set(buffers)
    mapper = _key_mapper(model, expected)

    plan = _Plan()
    targets: dict[str, _Tensor] = {}
    for key in sorted(checkpoint):
        target, converter = mapper(key)
        if converter is not None:
            raise NeedsFullLoad(
                f"transformers converts checkpoint tensor {key!r} at load time (pattern {converter!r} -> {target!r})"
            )
        if target not in expected:
            plan.unused.append(key)
            continue
        if target in targets:
            raise NeedsFullLoad(f"checkpoint tensors {targets[target].key!r} and {key!r} both map to {target!r}")
        targets[target] = checkpoint[key]

    for group in groups.values():
        present = [n for n in group if _canonical(n) in targets]
        if not present:
            raise NeedsFullLoad(
                f"parameter {_canonical(group[0])!r} is not in the checkpoint (from_pretrained would initialize it)"
            )
        if len(present) > 1:
            raise NeedsFullLoad(
                f"tied parameters {[_canonical(n) for n in present]} are each in the checkpoint "
                "(from_pretrained compares them and unties them if they differ)"
            )
        tensor = targets[_canonical(present[0])]
        param = model.get_parameter(group[0])
        _check_tensor(_canonical(present[0]), param, tensor)
        plan.params.append((group[0], tensor))
    for canonical, name in buffers.items():
        buf = model.get_buffer(name)
        if canonical in targets:
            _check_tensor(canonical, buf, targets[canonical])
            plan.buffers.append((name, targets[canonical]))
        elif buf.device.type == "meta":
            raise NeedsFullLoad(f"buffer {canonical!r} is on the meta device and not in the checkpoint")
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type == "meta" and name in module._non_persistent_buffers_set:
                fqn = f"{module_name}.{name}" if module_name else name
                raise NeedsFullLoad(f"non-persistent buffer {fqn!r} is on the meta device (no value to keep)")
    return plan


def _check_tensor(name: str, target: torch.Tensor, tensor: _Tensor) -> None:
    if tuple(target.shape) != tensor.shape:
        raise NeedsFullLoad(
            f"checkpoint tensor {tensor.key!r} has shape {list(tensor.shape)} and {name!r} {list(target.shape)}"
        )
    if target.is_floating_point() and tensor.dtype not in FLOAT_DTYPES:
        raise NeedsFullLoad(f"checkpoint tensor {tensor.key!r} is {tensor.dtype} and {name!r} is {target.dtype}")


def check_loadable(model: torch.nn.Module, model_path: Path) -> None:
    """Raise :class:`NeedsFullLoad` unless every parameter of ``model`` (built by
    :func:`build_on_meta`, before or after it is laid out) maps onto exactly one checkpoint tensor of
    its shape, by the names ``from_pretrained`` would use, and every DTensor placement maps onto an
    exact slice. Reads only the safetensors headers."""
    plan = _plan(model, Path(model_path))
    for name, _ in plan.params:
        _local_blocks(name, model.get_parameter(name))


# ---- which slice of each tensor this rank holds ---------------------------------------------


def _chunks(index: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``torch.chunk`` into exactly ``n`` pieces (the last ones empty if it makes fewer), as DTensor's
    ``Shard`` splits a dimension."""
    pieces = list(torch.chunk(index, n)) if len(index) else []
    return pieces + [index[:0]] * (n - len(pieces))


def _global_indices(name: str, param) -> list[torch.Tensor]:
    """For each dimension, the global indices of the rows (columns, ...) this rank's local tensor
    holds, in local order: the placements applied left to right, as DTensor does."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        _StridedShard = None
    mesh, placements = param.device_mesh, param.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise NeedsFullLoad(f"{name}: this rank is not in the parameter's device mesh")
    indices = [torch.arange(n) for n in param.shape]
    for mesh_dim, placement in enumerate(placements):
        n, rank = mesh.size(mesh_dim), coordinate[mesh_dim]
        if placement.is_replicate():
            continue
        if _StridedShard is not None and isinstance(placement, _StridedShard):
            dim = placement.dim % param.ndim
            first = _chunks(indices[dim], int(placement.split_factor))
            indices[dim] = torch.cat([_chunks(piece, n)[rank] for piece in first])
        elif placement.is_shard():
            dim = placement.dim % param.ndim
            indices[dim] = _chunks(indices[dim], n)[rank]
        else:
            raise NeedsFullLoad(f"{name}: DTensor placement {placement} is not a slice of the checkpoint tensor")
    local_shape = tuple(param.to_local().shape)
    if tuple(len(i) for i in indices) != local_shape:
        raise NeedsFullLoad(f"{name}: local shape {list(local_shape)} is not what its placements {placements} give")
    try:  # and torch agrees on the shape and where the shard starts
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return indices
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    starts = tuple(int(i[0]) if len(i) else o for i, o in zip(indices, offset))
    if tuple(shape) != local_shape or (all(len(i) for i in indices) and starts != tuple(offset)):
        raise NeedsFullLoad(f"{name}: cannot tell which slice placements {placements} give this rank")
    return indices


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of global indices: (global start, global stop, local start)."""
    if not len(index):
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, len(index)]
    return [(int(index[a]), int(index[a]) + b - a, a) for a, b in itertools.pairwise(bounds)]


def _local_blocks(name: str, param) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """(checkpoint slice, local slice) pairs that together fill this rank's part of ``param``."""
    if not _is_dtensor(param):
        full = tuple(slice(0, n) for n in param.shape)
        return [(full, full)] if all(param.shape) else []
    runs = [_runs(i) for i in _global_indices(name, param)]
    return [
        (tuple(slice(g0, g1) for g0, g1, _ in block), tuple(slice(l0, l0 + g1 - g0) for g0, g1, l0 in block))
        for block in itertools.product(*runs)
    ]


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


# ---- loading ---------------------------------------------------------------------------------


def _read_into(dest: torch.Tensor, tensor: _Tensor, blocks) -> int:
    """Copy the blocks of a checkpoint tensor into ``dest`` (cast to its dtype); returns bytes read.
    The file is opened for this tensor alone: closing it unmaps what was touched."""
    from safetensors import safe_open

    read = 0
    with safe_open(str(tensor.file), framework="pt", device="cpu") as f:
        if not tensor.shape:  # a scalar: no slicing
            value = f.get_tensor(tensor.key)
            dest.copy_(value)
            return value.numel() * value.element_size()
        part = f.get_slice(tensor.key)
        for source, local in blocks:
            value = part[source]
            dest[local].copy_(value)
            read += value.numel() * value.element_size()
            del value
        del part
    return read


def _materialize(model: torch.nn.Module, device: str) -> None:
    """``model.to_empty(device=...)`` (uninitialized storage for every parameter, DTensor local
    shards included, which FSDP2 re-pads), keeping what ``to_empty`` alone would lose: the buffers'
    values and the parameter objects themselves (tensors are swapped in place, so tied weights stay
    one parameter and FSDP2 keeps its references)."""
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    kept = []  # to_empty gives buffers new, empty storage too: their values go back in
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device.type != "meta":
                kept.append((module, name, buf))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for module, name, buf in kept:
        module._buffers[name].copy_(buf)
    for names in tied.values():  # swapping keeps ties; should a parameter have been replaced, tie again
        first = model.get_parameter(names[0])
        for name in names[1:]:
            if model.get_parameter(name) is not first:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, first)


@torch.no_grad()
def load_local_shards(model: torch.nn.Module, model_path: Path, device: str) -> dict:
    """Materialize ``model``'s parameters on ``device`` and fill each with its values from the
    checkpoint's safetensors files: a DTensor parameter (tensor parallelism, FSDP2, both) with this
    rank's local slice only, a plain parameter with the whole tensor, cast to the parameter's dtype.
    Call it after the model (from :func:`build_on_meta`) is laid out. Buffers keep their values
    (persistent ones the checkpoint holds are loaded); tied weights are loaded once. Raises
    :class:`NeedsFullLoad` before materializing anything if the checkpoint does not map onto the
    model one to one. Returns what was read, for the run record."""
    model_path = Path(model_path)
    plan = _plan(model, model_path)
    blocks = {name: _local_blocks(name, model.get_parameter(name)) for name, _ in plan.params}

    _materialize(model, device)

    bytes_read = bytes_total = 0
    for name, tensor in sorted(plan.params, key=lambda item: (str(item[1].file), item[1].key)):
        param = model.get_parameter(name)
        local = param.to_local() if _is_dtensor(param) else param
        bytes_read += _read_into(local, tensor, blocks[name])
        bytes_total += tensor.nbytes
    for name, tensor in plan.buffers:
        buf = model.get_buffer(name)
        full = tuple(slice(0, n) for n in buf.shape)
        bytes_read += _read_into(buf, tensor, [(full, full)] if all(buf.shape) else [])
        bytes_total += tensor.nbytes
    return {
        "method": METHOD,
        "bytes_read": bytes_read,
        "bytes_total": bytes_total,
        "tensors": len(plan.params) + len(plan.buffers),
    }
