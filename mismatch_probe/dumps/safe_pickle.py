"""Reading verl's pickled ``DataProto`` without running anything it names.

A pickle names callables and the unpickler calls them: ``pickle.load`` on a file from elsewhere
runs whatever it says. verl's own ``DataProto.__setstate__`` then calls ``torch.load(weights_only=
False)`` on the batch inside it. Here neither runs:

- the outer pickle goes through :class:`_OuterUnpickler`, whose ``find_class`` returns only
  the objects of an allow-list (NumPy arrays and scalars, a few builtins, ``torch.Size``) and a
  stand-in for ``verl.protocol.DataProto`` that just keeps its state; it imports nothing, and any
  other global is refused before it exists;
- the batch, a ``torch.save`` of tensordict's consolidated ``TensorDict`` (one flat uint8 storage
  and a table of where each tensor lies in it), loads with ``torch.load(weights_only=True)`` and
  stand-ins for tensordict's two rebuild functions that slice that storage into plain tensors;
- tensors inside ``non_tensor_batch`` (``torch.storage._load_from_bytes``) load with
  ``weights_only=True`` too.

Neither verl nor tensordict needs to be installed. Layout (verl/protocol.py, 0.7 - 0.9):
``pickle.dump(data_proto)`` -> ``DataProto`` NEWOBJ, BUILD ``(batch_bytes, non_tensor_batch,
meta_info)``; with ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy`` the batch is
``(batch_size, device, {key: (dtype, shape, uint8 array)})`` instead of bytes.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# NumPy 2's name; NumPy 1.26 has it too, as a stub over numpy.core. A pickle names the module of the
# NumPy that wrote it, so _ALLOWED takes both names.
import numpy._core.multiarray as _multiarray
import torch


class UnsafePickle(pickle.UnpicklingError):
    """The pickle names something outside the allow-list, or is not a DataProto."""


@dataclass
class DataProtoContent:
    """What a ``DataProto`` holds, as plain data: tensors by key (nested keys joined with '.')."""

    batch: dict[str, torch.Tensor] | None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


class _DataProtoState:
    """Stands in for ``verl.protocol.DataProto``: NEWOBJ makes it, BUILD hands it the state, kept as is."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3):
            raise UnsafePickle(f"a DataProto's state is a 3-tuple, not {type(state).__name__}")
        self.state = state


def _weights_only(data: bytes, what: str, allowed: list | None = None) -> Any:
    """``torch.load(weights_only=True)`` (plus ``allowed`` stand-ins); a refusal names the global."""
    try:
        with torch.serialization.safe_globals(allowed or []):
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL (\S+)", str(exc))
        why = f"names {named.group(1)}" if named else "is not tensors and plain data"
        raise UnsafePickle(f"its {what} {why}, which a verl DataProto does not hold") from None


def _tensor_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (a plain tensor pickled inside the outer pickle), minus
    the ``weights_only=False`` it uses."""
    return _weights_only(data, "tensor")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("verl.protocol", "DataProto"): _DataProtoState,
    ("torch", "Size"): torch.Size,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _tensor_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
for _module in ("numpy._core.multiarray", "numpy.core.multiarray"):
    _ALLOWED[(_module, "_reconstruct")] = _multiarray._reconstruct
    _ALLOWED[(_module, "scalar")] = _multiarray.scalar
for _name in dir(np.dtypes):  # NumPy 2 pickles dtypes by class (numpy.dtypes.Int32DType)
    if _name.endswith("DType"):
        _ALLOWED[("numpy.dtypes", _name)] = getattr(np.dtypes, _name)


class _OuterUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # imports nothing; only the allow-list
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickle(f"it names {module}.{name}, which a verl DataProto does not hold") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("it refers to external storage, which a DataProto pickle does not")


_DTYPES = {
    str(d): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}


class _Tensors(dict):
    """A TensorDict as {key: tensor}."""


def _consolidated(metadata: dict, storage: torch.Tensor) -> _Tensors:
    """Stand-in for ``tensordict._reductions._rebuild_tensordict_files_consolidated``:
    ``metadata["leaves"][key] = (dtype, shape, start, stop, pad)`` are byte ranges of ``storage``."""
    if not isinstance(storage, torch.Tensor) or storage.dtype != torch.uint8 or storage.dim() != 1:
        raise UnsafePickle("a consolidated TensorDict's storage is one flat uint8 tensor")
    out = _Tensors()

    def walk(meta: dict, prefix: str) -> None:
        meta = dict(meta)
        leaves = meta.pop("leaves", {})
        for key in ("non_tensors", "cls", "cls_metadata", "size"):
            meta.pop(key, None)
        for key, (dtype, shape, start, stop, pad) in leaves.items():
            if dtype not in _DTYPES or not 0 <= start <= stop <= storage.numel():
                raise UnsafePickle(f"tensor {key!r}: dtype {dtype!r} or bytes {start}..{stop} out of range")
            shape = torch.Size(shape)
            values = storage[start:stop].view(_DTYPES[dtype])
            out[prefix + key] = (values[: shape.numel()] if pad else values).view(shape)
        for sub, sub_meta in meta.items():  # what is left are nested TensorDicts
            if isinstance(sub_meta, dict):
                walk(sub_meta, f"{prefix}{sub}.")

    walk(metadata, "")
    return out


class _TensorDictClass:
    """Stands in for the ``tensordict.TensorDict`` class passed to ``_make_td``."""


def _make_td(cls: Any, state: dict) -> _Tensors:
    """Stand-in for ``tensordict._reductions._make_td`` (a TensorDict saved unconsolidated or empty)."""
    if not isinstance(state, dict):
        raise UnsafePickle("a TensorDict's state is a dict")
    out = _Tensors()
    for key, value in state.get("_tensordict", {}).items():
        if isinstance(value, _Tensors):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value
        else:
            raise UnsafePickle(f"TensorDict entry {key!r} is a {type(value).__name__}")
    return out


_INNER = [
    (_consolidated, "tensordict._reductions._rebuild_tensordict_files_consolidated"),
    (_make_td, "tensordict._reductions._make_td"),
    (_TensorDictClass, "tensordict._td.TensorDict"),
    (_TensorDictClass, "tensordict.TensorDict"),
]


def _batch_from_torch_bytes(data: bytes) -> _Tensors | None:
    if not data.startswith(b"PK\x03\x04"):
        raise UnsafePickle("its batch is not a torch.save archive")
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    if sum(n.endswith("/data.pkl") for n in names) != 1:
        raise UnsafePickle("its batch archive does not hold exactly one data.pkl")
    batch = _weights_only(data, "batch", _INNER)
    if batch is not None and not isinstance(batch, _Tensors):
        raise UnsafePickle(f"its batch is a {type(batch).__name__}, not a TensorDict")
    return batch


def _batch_from_numpy_mode(state: tuple) -> _Tensors:
    """``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``: {key: (dtype, shape, uint8 array)}."""
    _, _, items = state
    out = _Tensors()
    for key, entry in items.items():
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise UnsafePickle(f"batch entry {key!r} is not (dtype, shape, bytes)")
        dtype, shape, data = entry
        torch_dtype = _DTYPES.get(f"torch.{dtype}") or _DTYPES.get(str(dtype))
        if torch_dtype is None:
            raise UnsafePickle(f"batch entry {key!r} has dtype {dtype!r}")
        raw = np.asarray(data, dtype=np.uint8).tobytes()
        out[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch_dtype).view(tuple(shape))
    return out


def load_data_proto(data: bytes) -> DataProtoContent:
    """The content of a pickled verl ``DataProto``; :class:`UnsafePickle` for anything else."""
    obj = _OuterUnpickler(io.BytesIO(data)).load()
    if not isinstance(obj, _DataProtoState):
        raise UnsafePickle(f"it holds a {type(obj).__name__}, not a verl DataProto")
    batch_state, non_tensor_batch, meta_info = obj.state
    if isinstance(batch_state, (bytes, bytearray)):
        batch = _batch_from_torch_bytes(bytes(batch_state))
    elif isinstance(batch_state, tuple):
        batch = _batch_from_numpy_mode(batch_state)
    elif batch_state is None:
        batch = None
    else:
        raise UnsafePickle(f"its batch is a {type(batch_state).__name__}")
    return DataProtoContent(
        None if batch is None else dict(batch),
        dict(non_tensor_batch or {}),
        dict(meta_info or {}),
    )
