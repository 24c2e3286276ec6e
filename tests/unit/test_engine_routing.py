"""The vLLM and SGLang adapters' routed experts without starting either engine: when each asks for
them (and why not), how each answer becomes Completion.experts, and that the installed engines'
sources have the fields the adapters use (read as text: importing vLLM takes ~20 s here)."""

from __future__ import annotations

import ast
import base64
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import SGLANG_PYTHON

from mismatch_probe.config.spec import EngineSpec
from mismatch_probe.engines import sglang as sglang_adapter
from mismatch_probe.engines import vllm as vllm_adapter
from mismatch_probe.engines.routed_experts import MoeLayout
from mismatch_probe.errors import EngineError

VLLM_KNOWN = {"enable_return_routed_experts", "enable_prefix_caching"}
# deepseek-like: 4 decoder layers, the first dense; top-2 of 8
LAYOUT = MoeLayout(moe_layers=[1, 2, 3], top_k=2, num_experts=8, num_hidden_layers=4)


def vllm_refusal(spec: EngineSpec, *, on_cpu: bool = False, env: dict | None = None, known=VLLM_KNOWN):
    return vllm_adapter.routing_refusal(spec, on_cpu=on_cpu, version="0.32.0", known=known, env=env or {})


def test_vllm_asks_for_routing_where_its_requirements_hold():
    assert vllm_refusal(EngineSpec(name="vllm")) is None
    assert vllm_refusal(EngineSpec(name="vllm"), env={"VLLM_USE_V2_MODEL_RUNNER": "1"}) is None


def test_vllm_says_which_requirement_fails():
    spec = EngineSpec(name="vllm")
    assert vllm_refusal(spec, on_cpu=True) == vllm_adapter.ROUTING_UNAVAILABLE_CPU
    assert "has no engine argument enable_return_routed_experts" in vllm_refusal(spec, known=set())
    v1 = vllm_refusal(spec, env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert "V2 model runner" in v1 and "VLLM_USE_V2_MODEL_RUNNER=0" in v1
    no_cache = vllm_refusal(EngineSpec(name="vllm", prefix_caching=False))
    assert "prefix caching" in no_cache and "engine.prefix_caching is false" in no_cache
    assert "prefix caching" in vllm_refusal(EngineSpec(name="vllm", extra_args={"enable_prefix_caching": False}))
    pp = vllm_refusal(EngineSpec(name="vllm", pipeline_parallel_size=2))
    assert "pipeline parallelism" in pp and "pipeline_parallel_size is 2" in pp
    dcp = vllm_refusal(EngineSpec(name="vllm", extra_args={"decode_context_parallel_size": 2}))
    assert "context parallelism" in dcp and "decode_context_parallel_size is 2" in dcp


def test_vllm_own_refusal_is_read_from_its_validation_error():
    message = (
        "1 validation error for VllmConfig\n  Value error, AuxOutput Connector requires Model Runner V2; set "
        "VLLM_USE_V2_MODEL_RUNNER=1. [type=value_error, input_value=ArgsKwargs((), {...}), input_type=ArgsKwargs]"
    )
    why = vllm_adapter._routing_refused_by(ValueError(message))
    assert why == "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1."
    assert vllm_adapter._routing_refused_by(ValueError("max_model_len is too large")) is None


def test_sglang_asks_for_routing_with_chunked_prefill_where_its_capture_buffer_can_be_allocated():
    known = {"enable_return_routed_experts"}
    spec = EngineSpec(name="sglang")

    def refusal(device: str, cpu_allocator: str | None = None, spec=spec, known=known, version="0.5.23"):
        return sglang_adapter.routing_refusal(
            spec, device=device, version=version, known=known, cpu_allocator=cpu_allocator
        )

    assert refusal("cuda") is None
    # on CPU, what cpu_capture_allocator found: SGLang's own host-registering allocator (a stock
    # install; also what is assumed when nobody looked) refuses with its exact reason
    assert refusal("cpu") == refusal("cpu", "host_register") == sglang_adapter.ROUTING_UNAVAILABLE_CPU
    assert refusal("cpu", "unpinned") is None  # tests/sglang-cpu's hook in place
    assert refusal("cpu", "other") is None  # an allocator of that SGLang's own: ask it
    unknown = refusal("cpu", "unknown: No module named 'sglang.srt.state_capturer'", version="0.6.0")
    assert "SGLang 0.6.0's CPU engine" in unknown and "No module named 'sglang.srt.state_capturer'" in unknown
    # the other requirements still hold on CPU
    assert "26860" in refusal("cpu", "unpinned", spec=EngineSpec(name="sglang", chunked_prefill=False))
    missing = refusal("cuda", known=set(), version="0.5.0")
    assert "has no server argument enable_return_routed_experts" in missing
    assert "26860" in refusal("cuda", spec=EngineSpec(name="sglang", chunked_prefill=False))


def test_sglang_records_the_unpinned_capture_buffer_only_where_it_is_used():
    entry = sglang_adapter.unpinned_capture_workaround("unpinned")
    assert list(entry) == ["routed_experts_host_buffer_unpinned_on_cpu"]
    what = entry["routed_experts_host_buffer_unpinned_on_cpu"]["what"]
    assert "pin_memory=False" in what and "cudaHostRegister" in what and "device-to-host" in what
    for other in ("host_register", "other", None):
        assert sglang_adapter.unpinned_capture_workaround(other) == {}


def test_sglang_cpu_allocator_is_unknown_without_sglang():
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is importable here (tests/engines/test_sglang_engine.py reads the real one)")
    assert sglang_adapter.cpu_capture_allocator() == "unknown: No module named 'sglang'"


def vllm_engine(layout: MoeLayout | None = LAYOUT) -> vllm_adapter.VLLMEngine:
    engine = object.__new__(vllm_adapter.VLLMEngine)
    engine.routing, engine.version = layout, "0.32.0"
    return engine


def routed(prompt_len: int, n_gen: int, start: int, dtype) -> np.ndarray:
    """[positions from start, num_hidden_layers, top_k], layer 0 dense (zeros), ids in descending order."""
    positions = np.arange(start, prompt_len + n_gen - 1)
    out = np.zeros((len(positions), LAYOUT.num_hidden_layers, LAYOUT.top_k), dtype)
    for layer in LAYOUT.moe_layers:
        out[:, layer, 0] = (positions + layer) % 4 + 4
        out[:, layer, 1] = (positions + layer) % 4
    return out


def test_vllm_completion_output_becomes_experts():
    prompt_len, n_gen = 6, 4
    output = SimpleNamespace(routed_experts=routed(prompt_len, n_gen, prompt_len - 1, np.uint8))
    experts = vllm_engine()._experts(output, prompt_len, n_gen, 0)
    assert experts.dtype == np.int16 and experts.shape == (n_gen, 3, 2)
    positions = np.arange(prompt_len - 1, prompt_len + n_gen - 1)
    assert np.array_equal(
        experts[:, 0], np.stack([(positions + 1) % 4, (positions + 1) % 4 + 4], -1)
    )  # MoE layer 1, sorted
    assert vllm_engine(None)._experts(output, prompt_len, n_gen, 0) is None
    with pytest.raises(EngineError, match="returned no routed experts for request 3"):
        vllm_engine()._experts(SimpleNamespace(routed_experts=None), prompt_len, n_gen, 3)


def sglang_engine(layout: MoeLayout | None = LAYOUT) -> sglang_adapter.SGLangEngine:
    engine = object.__new__(sglang_adapter.SGLangEngine)
    engine.routing, engine.version = layout, "0.5.23"
    return engine


def test_sglang_meta_info_becomes_experts_from_the_batch_start():
    """One start for the batch (the shortest prompt's last position): a longer prompt's answer
    begins earlier than its own last position and is sliced."""
    start, prompt_len, n_gen = 3, 9, 5
    flat = base64.b64encode(routed(prompt_len, n_gen, start, np.int32).tobytes()).decode()
    experts = sglang_engine()._experts({"routed_experts": flat}, prompt_len, start, n_gen, 0)
    want = np.sort(routed(prompt_len, n_gen, prompt_len - 1, np.int32)[:, 1:], axis=-1).astype(np.int16)
    assert np.array_equal(experts, want)
    with pytest.raises(EngineError, match=r"\(sampling request 2\) returned no routed experts"):
        sglang_engine()._experts({}, prompt_len, start, n_gen, 2)
    full = base64.b64encode(routed(prompt_len, n_gen, 0, np.int32).tobytes()).decode()
    with pytest.raises(EngineError, match="it ignored the start"):
        sglang_engine()._experts({"routed_experts": full}, prompt_len, start, n_gen, 0)


# ---- the installed engines have the fields the adapters use ------------------------------------


def class_fields(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def function_args(path: Path, cls: str, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name)
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    return Path(spec.origin).parent


def sglang_root() -> Path:
    if SGLANG_PYTHON is None:
        pytest.skip("SGLang is not installed")
    found = sorted(Path(SGLANG_PYTHON).resolve().parent.parent.glob("lib/python3*/site-packages/sglang"))
    if not found:
        found = sorted(Path(SGLANG_PYTHON).parent.parent.glob("lib/python3*/site-packages/sglang"))
    if not found:
        pytest.skip(f"no sglang package beside {SGLANG_PYTHON}")
    return found[0]


def test_the_installed_vllm_has_the_fields_the_adapter_uses():
    root = vllm_root()
    assert "enable_return_routed_experts" in class_fields(root / "engine" / "arg_utils.py", "EngineArgs")
    assert "routed_experts_prompt_start" in class_fields(root / "sampling_params.py", "SamplingParams")
    assert "routed_experts" in class_fields(root / "outputs.py", "CompletionOutput")
    protocol = root / "entrypoints" / "openai" / "completion" / "protocol.py"
    assert "routed_experts_prompt_start" in class_fields(protocol, "CompletionRequest")
    assert "routed_experts" in class_fields(protocol, "CompletionResponseChoice")
    source = (root / "config" / "vllm.py").read_text()
    for line in ("AuxOutput Connector requires Model Runner V2", "AuxOutput Connector requires prefix caching."):
        assert line in source


def test_the_installed_sglang_has_the_fields_the_adapter_uses():
    root = sglang_root() / "srt"
    assert {"return_routed_experts", "routed_experts_start_len"} <= class_fields(
        root / "managers" / "io_struct.py", "GenerateReqInput"
    )
    assert {"return_routed_experts", "routed_experts_start_len"} <= function_args(
        root / "entrypoints" / "engine.py", "Engine", "generate"
    )
    assert "enable_return_routed_experts" in (root / "arg_groups" / "fields" / "exec_.py").read_text()
    assert 'meta_info["routed_experts"]' in (root / "managers" / "tokenizer_manager.py").read_text()


def test_the_installed_sglang_allocates_the_capture_buffer_where_the_cpu_hook_patches_it():
    """tests/sglang-cpu's import hook and the adapter's cpu_capture_allocator read one table: the
    allocator BaseHostCache takes from state_capturer/base.py's ALLOC_MEMORY_FUNCS, which for "cpu"
    is the default, alloc_with_host_register (pool_host/common.py)."""
    root = sglang_root() / "srt"
    base = (root / "state_capturer" / "base.py").read_text()
    assert "ALLOC_MEMORY_FUNCS,\n" in base and "alloc = ALLOC_MEMORY_FUNCS[device]" in base
    assert "pin_memory=True," in base
    common = (root / "mem_cache" / "pool_host" / "common.py").read_text()
    table = common[common.index("ALLOC_MEMORY_FUNCS = defaultdict(") :]
    table = table[: table.index("\n)\n")]
    assert "lambda: alloc_with_host_register" in table and '"cpu"' not in table
    assert "def alloc_with_host_register(" in common and "cudart = torch.cuda.cudart()" in common
