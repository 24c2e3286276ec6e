"""A pickle that would run code is refused, and nothing in it runs: not at the top level, not in
the DataProto's non-tensor batch, not inside its torch.save'd batch, not behind a tensor's bytes.
Each payload would create a marker file; the test checks the file never appears."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import sys
import types

import numpy as np
import pytest
import torch
from conftest import DENSE, cli

from mismatch_probe.dumps.safe_pickle import UnsafePickle, load_data_proto


class RunsCode:
    """Unpickling this calls os.system (what a malicious dump would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def data_proto_pickle(batch_bytes, non_tensor_batch=None, meta_info=None) -> bytes:
    """A pickle naming verl.protocol.DataProto, as DataProto.save_to_disk writes one (NEWOBJ, then
    BUILD with (batch, non_tensor_batch, meta_info)), made without verl."""
    module = types.ModuleType("verl.protocol")

    class DataProto:
        def __reduce_ex__(self, protocol):  # copyreg.__newobj__: pickle writes NEWOBJ, then BUILD(state)
            return (copyreg.__newobj__, (DataProto,), self.state)

    DataProto.__module__, DataProto.__qualname__ = "verl.protocol", "DataProto"
    module.DataProto = DataProto
    saved = {name: sys.modules.get(name) for name in ("verl", "verl.protocol")}
    sys.modules["verl"], sys.modules["verl.protocol"] = types.ModuleType("verl"), module
    try:
        dp = DataProto()
        dp.state = (batch_bytes, non_tensor_batch or {}, meta_info or {})
        return pickle.dumps(dp, protocol=4)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def payloads(marker) -> dict[str, bytes]:
    objects = np.empty(1, dtype=object)
    objects[0] = RunsCode(marker)
    return {
        "top level": pickle.dumps(RunsCode(marker)),
        "non-tensor batch": data_proto_pickle(None, {"uid": objects}),
        "meta_info": data_proto_pickle(None, meta_info={"timing": RunsCode(marker)}),
        "inside the torch.save'd batch": data_proto_pickle(torch_bytes({"x": RunsCode(marker)})),
        "behind a tensor's bytes": data_proto_pickle(
            None, {"t": _tensor_from_bytes_reducing_to(torch_bytes(RunsCode(marker)))}
        ),
        "eval": pickle.dumps(_Eval(f"__import__('os').system('touch {marker}')")),
    }


class _Eval:
    def __init__(self, source):
        self.source = source

    def __reduce__(self):
        return (eval, (self.source,))


class _FromBytes:
    def __init__(self, data):
        self.data = data

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.data,))


def _tensor_from_bytes_reducing_to(data: bytes):
    return _FromBytes(data)


@pytest.mark.parametrize(
    "where",
    ["top level", "non-tensor batch", "meta_info", "inside the torch.save'd batch", "behind a tensor's bytes", "eval"],
)
def test_a_malicious_pickle_is_refused_and_nothing_runs(where, tmp_path):
    marker = tmp_path / "pwned"
    data = payloads(marker)[where]
    with pytest.raises(UnsafePickle):
        load_data_proto(data)
    assert not marker.exists()


def test_the_cli_refuses_it_naming_the_flag_and_what_it_names(tmp_path):
    marker = tmp_path / "pwned"
    step_dir = tmp_path / "dump" / "exp_proj" / "GBS1_N1_in4_out4" / "1"
    step_dir.mkdir(parents=True)
    (step_dir / "gen_batch.dp").write_bytes(payloads(marker)["non-tensor batch"])
    without = cli("import", "verl", str(tmp_path / "dump"), "--model", str(DENSE), "--out", str(tmp_path / "a"))
    assert without.returncode == 2 and "pass --trust-pickle" in without.stderr
    with_flag = cli(
        "import", "verl", str(tmp_path / "dump"), "--model", str(DENSE), "--out", str(tmp_path / "b"), "--trust-pickle"
    )
    assert with_flag.returncode == 2
    assert "gen_batch.dp was refused: it names posix.system, which a verl DataProto does not hold" in with_flag.stderr
    assert "nothing in it was run" in with_flag.stderr and "Traceback" not in with_flag.stderr
    assert not marker.exists()


def test_a_benign_data_proto_loads_to_plain_tensors():
    batch = torch_bytes(None)
    content = load_data_proto(data_proto_pickle(batch, {"uid": np.array(["a", "b"], dtype=object)}, {"k": 1}))
    assert (
        content.batch is None
        and content.non_tensor_batch["uid"].tolist() == ["a", "b"]
        and content.meta_info == {"k": 1}
    )
