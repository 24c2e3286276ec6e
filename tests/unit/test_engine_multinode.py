"""The engines' multi-GPU / multi-node settings (docs/engines-multinode.md) without starting an engine:
the spec keys, the vLLM EngineArgs and SGLang ServerArgs each maps to (checked against the installed
engines' own field names, read from their source), and the refusals, each one line with a hint.
The real engines run them in tests/engines/test_multinode_engines.py."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
from conftest import DENSE, SGLANG_PYTHON, SINGLE_TURN
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.config.spec import EngineSpec, ProbeSpec, flag_of
from mismatch_probe.config.spec_reading import spec_from_dict
from mismatch_probe.engines import BUILTIN_ENGINES, get_entry
from mismatch_probe.engines import sglang_args as sglang_adapter
from mismatch_probe.engines import vllm_args as vllm_adapter
from mismatch_probe.engines.cpu_threads import cpu_thread_binding
from mismatch_probe.errors import ConfigError

LAYOUT = ("pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank", "dist_init_addr")


def spec(engine: dict) -> ProbeSpec:
    return spec_from_dict({"model": "m", "prompts": "p", "engine": engine})


def refusal(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.exit_code == 2 and "\n" not in str(err) and err.hint, str(err)
    return err


# ---- the spec keys ------------------------------------------------------------------------------


def test_the_keys_parse_validate_and_are_recorded():
    plain = spec({"name": "vllm"})
    before = (plain.fingerprint(), plain.rollout_fingerprint())
    assert set(LAYOUT + ("distributed_executor_backend",)) <= set(plain.to_dict()["engine"])
    # a schema-3 record held them only when set, so its fingerprints did not change with them
    assert not set(LAYOUT + ("distributed_executor_backend",)) & set(plain.dump(3)["engine"])
    s = spec(
        {
            "name": "vllm",
            "tensor_parallel_size": 4,
            "pipeline_parallel_size": 2,
            "nnodes": 2,
            "dist_init_addr": "10.0.0.1:29500",
            "distributed_executor_backend": "mp",
        }
    ).normalized()
    recorded = s.to_dict()["engine"]
    assert (recorded["pipeline_parallel_size"], recorded["nnodes"], recorded["dist_init_addr"]) == (
        2,
        2,
        "10.0.0.1:29500",
    )
    assert (recorded["node_rank"], recorded["data_parallel_size"]) == (0, 1)
    assert (plain.fingerprint(), plain.rollout_fingerprint()) == before != (s.fingerprint(), s.rollout_fingerprint())
    assert EngineSpec(**s.engine.model_dump()) == s.engine  # what the engine worker rebuilds from the wire


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"pipeline_parallel_size": 0}, "engine.pipeline_parallel_size must be >= 1, got 0"),
        ({"data_parallel_size": 0}, "engine.data_parallel_size must be >= 1"),
        ({"nnodes": 2}, "engine.nnodes = 2 needs engine.dist_init_addr"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, r"node_rank must be in \[0, nnodes = 2\), got 2"),
        ({"dist_init_addr": "10.0.0.1"}, "'10.0.0.1' is not HOST:PORT"),
        ({"dist_init_addr": "fd00::1:29500"}, "is not HOST:PORT"),  # IPv6 needs brackets
        ({"dist_init_addr": "h:70000"}, "is not HOST:PORT"),
        ({"distributed_executor_backend": "mpi"}, "must be one of mp, ray, uni, external_launcher, got 'mpi'"),
    ],
)
def test_bad_values_are_refused_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message) as info:
        spec({"name": "vllm", **settings})
    assert "\n" not in str(info.value)


def test_addresses_split_into_host_and_port():
    def split(address):
        return EngineSpec(dist_init_addr=address).dist_init_host_port()

    assert split("10.0.0.1:29500") == ("10.0.0.1", 29500) and EngineSpec().dist_init_host_port() is None
    assert split("node-0.cluster:1234") == ("node-0.cluster", 1234)
    assert split("[fd00::1]:29500") == ("fd00::1", 29500)
    assert vllm_adapter.join_address("fd00::1", 29500) == "[fd00::1]:29500"


def test_a_bad_layout_exits_2_before_anything_is_written(tmp_path):
    path = tmp_path / "probe.toml"
    path.write_text(f'model = "{DENSE}"\nprompts = "{SINGLE_TURN}"\n[engine]\nname = "vllm"\ndata_parallel_size = 2\n')
    result = CliRunner().invoke(app, ["compare", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "refuses data_parallel_size=2" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


# ---- which engine has which key -----------------------------------------------------------------


def test_each_engine_lists_the_keys_it_maps():
    assert set(LAYOUT) | {"distributed_executor_backend"} <= BUILTIN_ENGINES["vllm"].settings
    assert set(LAYOUT) <= BUILTIN_ENGINES["sglang"].settings
    mapped_vllm = set(vllm_adapter.ARGS) | {"dist_init_addr"}
    assert BUILTIN_ENGINES["vllm"].settings & (set(LAYOUT) | {"distributed_executor_backend"}) <= mapped_vllm
    assert BUILTIN_ENGINES["sglang"].settings & set(LAYOUT) <= set(sglang_adapter.ARGS)
    for name, value in [
        ("pipeline_parallel_size", 2),
        ("dist_init_addr", "h:1"),
        ("distributed_executor_backend", "mp"),
    ]:
        err = refusal(get_entry("hf").check_settings, EngineSpec(name="hf", **{name: value}))
        assert f"no setting engine.{name} ({flag_of('engine.' + name)})" in err.message
    err = refusal(get_entry("sglang").check_settings, EngineSpec(name="sglang", distributed_executor_backend="ray"))
    assert "it applies to: vllm" in err.hint


# ---- vLLM ---------------------------------------------------------------------------------------


def _annotated_names(path: Path, class_name: str | None = None) -> set[str]:
    """The annotated attribute names of a class (a dataclass's fields), or of every class in a file."""
    tree = ast.parse(path.read_text())
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and class_name in (None, n.name)]
    return {
        s.target.id for c in classes for s in c.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }


def _vllm_engine_args_fields() -> set[str]:
    found = importlib.util.find_spec("vllm")  # a top-level find_spec imports nothing
    if found is None or not found.submodule_search_locations:
        pytest.skip("vLLM is not installed here")
    return _annotated_names(Path(found.submodule_search_locations[0]) / "engine" / "arg_utils.py", "EngineArgs")


MULTINODE_VLLM = EngineSpec(
    name="vllm",
    logprobs_mode="raw",
    tensor_parallel_size=8,
    pipeline_parallel_size=2,
    nnodes=2,
    dist_init_addr="10.0.0.1:29500",
    distributed_executor_backend="mp",
)


def test_vllm_maps_the_layout_onto_engine_args_of_the_installed_vllm():
    known = _vllm_engine_args_fields()
    args = vllm_adapter.engine_args(MULTINODE_VLLM, "/m", trust_remote_code=False, version="0.32.0", known=known)
    assert {k: args[k] for k in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes")} == {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "nnodes": 2,
    }
    assert (args["master_addr"], args["master_port"], args["distributed_executor_backend"]) == ("10.0.0.1", 29500, "mp")
    assert set(args) - {"model"} <= known  # every name is the installed vLLM's own
    # the defaults are left to vLLM (an older vLLM lacks the arguments altogether)
    plain = vllm_adapter.engine_args(
        EngineSpec(name="vllm", logprobs_mode="raw"), "/m", trust_remote_code=False, version="0.32.0", known=known
    )
    assert not {"pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank", "master_addr"} & set(plain)
    # a vLLM without multi-node mp says so instead of failing in EngineArgs
    err = refusal(
        vllm_adapter.engine_args,
        MULTINODE_VLLM,
        "/m",
        trust_remote_code=False,
        version="0.8.0",
        known=known - {"nnodes", "node_rank", "master_addr", "master_port"},
    )
    assert "vLLM 0.8.0 has no engine argument 'nnodes', so engine.nnodes cannot be honored" in err.message
    # mismatch-probe's key and vLLM's own cannot both be given
    both = MULTINODE_VLLM.model_copy(update={"extra_args": {"master_port": 1}})
    with pytest.raises(ConfigError, match="'master_port', which mismatch-probe sets itself"):
        vllm_adapter.engine_args(both, "/m", trust_remote_code=False, version="0.32.0", known=known)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"data_parallel_size": 2}, "offline engine .* refuses data_parallel_size=2"),
        ({"distributed_executor_backend": "external_launcher"}, "one vLLM engine in every torchrun rank"),
        ({"distributed_executor_backend": "uni", "pipeline_parallel_size": 2}, "'uni' runs the model in one process"),
        (
            {"distributed_executor_backend": "ray", "nnodes": 2, "dist_init_addr": "h:1", "tensor_parallel_size": 2},
            "nnodes only under its 'mp' backend, not 'ray'",
        ),
        (
            {"nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:29500", "tensor_parallel_size": 2},
            "mismatch-probe runs vLLM's node rank 0",
        ),
        ({"nnodes": 3, "dist_init_addr": "h:1", "tensor_parallel_size": 2}, "nnodes = 3 must divide the 2 ranks"),
    ],
)
def test_vllm_refuses_what_its_offline_engine_cannot_run_before_the_engine_starts(settings, message):
    err = refusal(get_entry("vllm").check_settings, EngineSpec(name="vllm", **settings))
    assert re.search(message, err.message), err.message


def test_vllm_names_the_commands_for_the_other_nodes():
    s = EngineSpec(name="vllm", nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500", tensor_parallel_size=8)
    err = refusal(vllm_adapter.check_spec, s)
    assert "vllm serve MODEL --headless --nnodes 2 --node-rank R --master-addr 10.0.0.1 --master-port 29500" in err.hint


def test_vllm_platform_checks():
    check = vllm_adapter.check_platform
    ray = EngineSpec(name="vllm", distributed_executor_backend="ray", tensor_parallel_size=2)
    err = refusal(check, ray, on_cpu=False, version="0.32.0", ray_installed=False)
    assert "needs Ray, which is not installed" in err.message and "ray start --head" in err.hint
    check(ray, on_cpu=False, version="0.32.0", ray_installed=True)
    # CPU: pipeline parallelism runs compiled only; 'uni' is replaced by 'mp'
    eager_pp = EngineSpec(name="vllm", pipeline_parallel_size=2, enforce_eager=True)
    err = refusal(check, eager_pp, on_cpu=True, version="0.32.0", ray_installed=False)
    assert "cannot run pipeline parallelism eagerly" in err.message and "drop --enforce-eager" in err.hint
    check(eager_pp, on_cpu=False, version="0.32.0", ray_installed=False)  # a GPU's runner has no such gap
    check(eager_pp.model_copy(update={"enforce_eager": None}), on_cpu=True, version="0.32.0", ray_installed=False)
    uni = EngineSpec(name="vllm", distributed_executor_backend="uni")
    err = refusal(check, uni, on_cpu=True, version="0.32.0", ray_installed=False)
    assert "replaces distributed_executor_backend 'uni' with 'mp'" in err.message
    # several nodes are mapped, not refused, on either platform (the other nodes are the user's)
    for on_cpu in (True, False):
        check(MULTINODE_VLLM, on_cpu=on_cpu, version="0.32.0", ray_installed=False)
        vllm_adapter.check_spec(MULTINODE_VLLM)


def test_vllm_ranks_per_node_size_the_cpu_binding_and_the_kv_cache():
    assert vllm_adapter.local_world_size(MULTINODE_VLLM) == 8  # 8 x 2 ranks over 2 nodes
    assert vllm_adapter.local_world_size(EngineSpec(name="vllm", pipeline_parallel_size=2)) == 2
    cfg = {"num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    # a pipeline stage caches its own layers: 5 layers over 2 stages, the larger one has 3
    assert vllm_adapter.kv_bytes_per_token(cfg, 2, pp=2) == 2 * 3 * 2 * 64 * 2
    b = vllm_adapter.cpu_kv_cache_budget(
        cfg, dtype_bytes=2, tp=1, pp=2, max_num_seqs=4, max_model_len=100, available_bytes=10_000_000, weights_bytes=0
    )
    assert (
        b["cap_bytes"] == int(vllm_adapter.CPU_KV_CACHE_SHARE * 10_000_000 / 2) and "2 ranks on the node" in b["rule"]
    )


def test_the_cpu_binding_gives_each_rank_its_own_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_thread_binding(2, "VLLM_CPU_OMP_THREADS_BIND") == "0-1|2-3"
    with pytest.raises(ConfigError, match="pipeline_parallel_size 8 needs at least one CPU core per rank") as info:
        cpu_thread_binding(8, "VLLM_CPU_OMP_THREADS_BIND", layout="tensor_parallel_size 1 x pipeline_parallel_size 8")
    assert "VLLM_CPU_OMP_THREADS_BIND" in info.value.hint


# ---- SGLang -------------------------------------------------------------------------------------


def _sglang_server_args_fields() -> set[str]:
    if SGLANG_PYTHON is None:
        pytest.skip("no SGLang venv (tests/sglang-cpu/install.sh)")
    roots = list(Path(SGLANG_PYTHON).parents[1].glob("lib/python3*/site-packages/sglang/srt"))
    if not roots:
        pytest.skip(f"cannot find SGLang's source next to {SGLANG_PYTHON}")
    srt = roots[0]
    names = _annotated_names(srt / "server_args.py", "ServerArgs")
    for path in (srt / "arg_groups" / "fields").glob("*.py"):  # SGLang >= 0.5.2x: ServerArgs in namespaces
        names |= _annotated_names(path)
    return names


def test_sglang_maps_the_layout_onto_server_args_of_the_installed_sglang():
    known = _sglang_server_args_fields()
    s = EngineSpec(
        name="sglang",
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        data_parallel_size=2,
        nnodes=2,
        dist_init_addr="10.0.0.1:5000",
    )
    args, defaults = sglang_adapter.server_args(
        s, "/m", device="cuda", trust_remote_code=False, version="0.5.23", known=known
    )
    assert {k: args[k] for k in ("tp_size", "pp_size", "dp_size", "nnodes", "dist_init_addr")} == {
        "tp_size": 4,
        "pp_size": 2,
        "dp_size": 2,
        "nnodes": 2,
        "dist_init_addr": "10.0.0.1:5000",
    }
    assert "node_rank" not in args and defaults == {"random_seed": 0}  # rank 0 is SGLang's own default
    assert set(args) - {"model_path"} <= known
    assert {"pp_size", "dp_size", "nnodes", "node_rank", "dist_init_addr"} <= set(sglang_adapter.RECORDED)
    plain, _ = sglang_adapter.server_args(
        EngineSpec(name="sglang"), "/m", device="cpu", trust_remote_code=False, version="0.5.23", known=known
    )
    assert not {"tp_size", "pp_size", "dp_size", "nnodes", "node_rank", "dist_init_addr"} & set(plain)
    err = refusal(
        sglang_adapter.server_args, s, "/m", device="cuda", trust_remote_code=False, version="0.4.0", known={"tp_size"}
    )
    assert "SGLang 0.4.0 has no server argument 'pp_size'" in err.message


def test_sglang_on_cpu_sleeps_when_idle_where_the_installed_sglang_can():
    """An idle SGLang scheduler busy-polls a core unless sleep_on_idle; on CPU mismatch-probe sets it
    (a default the user's own value overrides), and only where the installed SGLang has the argument."""
    known = _sglang_server_args_fields()
    assert "sleep_on_idle" in known  # the SGLang the tests install
    spec = EngineSpec(name="sglang")
    args, defaults = sglang_adapter.server_args(
        spec, "/m", device="cpu", trust_remote_code=False, version="0.5.23", known=known
    )
    assert args["sleep_on_idle"] is True and defaults["sleep_on_idle"] is True
    on_gpu, _ = sglang_adapter.server_args(
        spec, "/m", device="cuda", trust_remote_code=False, version="0.5.23", known=known
    )
    assert "sleep_on_idle" not in on_gpu
    older, _ = sglang_adapter.server_args(
        spec, "/m", device="cpu", trust_remote_code=False, version="0.4.0", known=known - {"sleep_on_idle"}
    )
    assert "sleep_on_idle" not in older
    mine = spec.model_copy(update={"extra_args": {"sleep_on_idle": False}})
    args, defaults = sglang_adapter.server_args(
        mine, "/m", device="cpu", trust_remote_code=False, version="0.5.23", known=known
    )
    assert args["sleep_on_idle"] is False and "sleep_on_idle" not in defaults


def test_sglang_runs_node_rank_0_and_names_the_command_for_the_others():
    s = EngineSpec(name="sglang", nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000", pipeline_parallel_size=2)
    err = refusal(get_entry("sglang").check_settings, s)
    assert "mismatch-probe runs SGLang's node rank 0" in err.message
    assert "sglang.launch_server --model-path MODEL --nnodes 2 --node-rank R --dist-init-addr 10.0.0.1:5000" in err.hint
    get_entry("sglang").check_settings(s.model_copy(update={"node_rank": 0, "data_parallel_size": 2}))


def test_sglang_binds_every_rank_on_cpu():
    s = EngineSpec(name="sglang", pipeline_parallel_size=2, data_parallel_size=2)
    assert sglang_adapter.world_size(s) == sglang_adapter.local_world_size(s) == 4
    two_nodes = s.model_copy(update={"nnodes": 2, "data_parallel_size": 1})
    assert (sglang_adapter.world_size(two_nodes), sglang_adapter.local_world_size(two_nodes)) == (2, 1)


def test_the_report_labels_the_layout_the_engine_reported():
    from mismatch_probe.record import RunRecord
    from mismatch_probe.report.labels import engine_label

    vllm_run = {
        "engine": "vllm",
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "nnodes": 2,
    }
    assert engine_label(RunRecord.model_validate({"spec": {}, "engine": vllm_run})) == "vllm bf16 TP2 PP2 2 nodes"
    sglang_run = {"engine": "sglang", "dtype": "bfloat16", "pp_size": 1, "dp_size": 2, "nnodes": 1}
    assert engine_label(RunRecord.model_validate({"spec": {}, "engine": sglang_run})) == "sglang bf16 DP2"


def test_where_the_nodes_meet_is_no_sweep_axis_but_the_layout_is():
    spec({"name": "vllm"})  # the helper's spec, with a [sweep] below
    spec_from_dict({"sweep": {"axes": [{"key": "engine.pipeline_parallel_size", "values": [1, 2]}]}})
    for key, value in (("engine.dist_init_addr", "h:1"), ("engine.node_rank", 0)):
        with pytest.raises(ConfigError, match=f"{key} cannot be a sweep axis"):
            spec_from_dict({"sweep": {"axes": [{"key": key, "values": [value]}]}})
