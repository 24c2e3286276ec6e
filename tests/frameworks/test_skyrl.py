"""SkyRL's own launch scripts (tests/frameworks/configs/skyrl, at a956457) read as SkyRL reads its
command line, with its config dataclasses' defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

from mismatch_probe.errors import ConfigError

# SkyRL's defaults at a956457 (skyrl/train/config/config.py) and what its code fixes
SKYRL_DEFAULTS = {
    "engine.name": "vllm",
    "engine.dtype": "bfloat16",
    "engine.tensor_parallel_size": 1,
    "engine.pipeline_parallel_size": 1,
    "engine.data_parallel_size": 1,
    "engine.gpu_memory_utilization": 0.8,
    "engine.enforce_eager": False,
    "engine.prefix_caching": True,
    "engine.max_num_seqs": 1024,
    "engine.max_num_batched_tokens": 8192,
    "engine.logprobs_mode": "raw",  # never set: vLLM's default
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "sampling.top_k": -1,
    "sampling.n": 5,
    "sampling.max_tokens": 1024,
    "reference.logprobs": "temperature",  # model_wrapper.py:334
    "reference.fsdp": True,
    "reference.dtype": "float32",
    "reference.fsdp_param_dtype": "bfloat16",
    "reference.fsdp_reduce_dtype": "float32",
    "reference.attn_implementation": "flash_attention_2",
    "reference.packing": True,
    "reference.sequence_parallel_size": 1,
}
SYNC = {"generator.inference_engine.weight_sync_backend": "nccl"}


def test_grpo_gsm8k_at_temperature_1():
    stack = read("skyrl", "run_gsm8k.sh")
    check_values(stack, SKYRL_DEFAULTS)
    assert from_user(stack) == {
        "engine.name",
        "engine.tensor_parallel_size",
        "engine.gpu_memory_utilization",
        "reference.fsdp",
        "sampling.n",
        "sampling.max_tokens",
    }
    # `: "${INFERENCE_BACKEND:=vllm}"` and `$NUM_GPUS` resolve as bash would
    assert stack.values["engine.name"].origins[0].key == "generator.inference_engine.backend"
    assert stack.model.value == "Qwen/Qwen2.5-1.5B-Instruct"
    assert stack.dataset.value == ["$HOME/data/gsm8k/train.parquet"]
    assert stack.engine_pin == "vllm==0.26.0 (pyproject.toml:116)"
    assert unmirrored(stack) == SYNC
    # raw engine log-probs against logits / T, but at T = 1 they are the same distribution
    assert risk_ids(stack) == {"cascade-attention"}


def test_livecodebench_at_temperature_0_6_with_top_p():
    stack = read("skyrl", "run_lcb.sh")
    check_values(
        stack,
        {
            **SKYRL_DEFAULTS,
            "engine.tensor_parallel_size": 4,
            "engine.gpu_memory_utilization": 0.7,
            "sampling.temperature": 0.6,
            "sampling.top_p": 0.95,
            "sampling.max_tokens": 3000,
        },
    )
    assert stack.dataset.value == ["$HOME/data/lcb/deepcoder_train.json"]
    assert stack.model.value == "Qwen/Qwen2.5-3B-Instruct"
    assert unmirrored(stack) == SYNC
    risks = risk_ids(stack)
    assert risks == {"logprobs-temperature", "truncated-sampling", "cascade-attention"}
    assert "model_wrapper.py:334" in stack.fact("evidence:logprobs-temperature")


def test_dapo_through_its_own_entrypoint():
    stack = read("skyrl", "run_dapo_gsm8k.sh")
    check_values(stack, {**SKYRL_DEFAULTS, "engine.enforce_eager": True})
    assert "engine.enforce_eager" in from_user(stack)
    assert unmirrored(stack) == SYNC


def test_logprobs_mode_through_engine_init_kwargs_clears_the_risk():
    stack = read(
        "skyrl",
        "run_lcb.sh",
        "generator.inference_engine.engine_init_kwargs.logprobs_mode=processed_logprobs",
        "generator.inference_engine.engine_init_kwargs.disable_cascade_attn=true",
    )
    assert stack.value("engine.logprobs_mode") == "processed"
    assert stack.value("engine.cascade_attn") is False
    assert "logprobs-temperature" not in risk_ids(stack)
    assert "cascade-attention" not in risk_ids(stack)


def test_trainer_temperature_set_apart_from_sampling():
    stack = read("skyrl", "run_lcb.sh", "trainer.algorithm.temperature=1.0")
    assert "sampling-disagrees" in risk_ids(stack)
    assert "sampling-disagrees" not in risk_ids(read("skyrl", "run_lcb.sh"))


def test_off_policy_corrections_and_precision():
    oc = "trainer.algorithm.off_policy_correction."
    stack = read(
        "skyrl",
        "run_gsm8k.sh",
        f"{oc}tis_ratio_type=token",
        f"{oc}sequence_mask_metric=geometric",
        f"{oc}token_mask_is_threshold_low=0.1",
        f"{oc}token_mask_is_threshold_high=10",
        f"{oc}outlier_token_is_threshold_low=1e-4",
        f"{oc}product_mask_low=0.3",
        "trainer.policy.fsdp_config.mixed_precision.param_dtype=fp16",
        "trainer.flash_attn=false",
    )
    assert stack.value("corrections.token_tis") == 2.0
    assert stack.value("corrections.geo_eps") == pytest.approx(0.01)
    assert (stack.value("corrections.token_mask_low"), stack.value("corrections.token_mask_high")) == (0.1, 10.0)
    assert stack.value("corrections.worst_token_tau") == 1e-4
    assert "corrections.seq_mis" not in stack.values  # product is not the metric
    assert stack.value("reference.fsdp_param_dtype") == "float16"
    assert stack.value("reference.attn_implementation") == "sdpa"
    assert unmirrored(stack) == {**SYNC, f"{oc}product_mask_low": 0.3}
    assert "precision-differs" in risk_ids(stack)  # bf16 engine, fp16 FSDP params


def test_external_servers_and_megatron():
    stack = read(
        "skyrl",
        "generator.inference_engine.run_engines_locally=false",
        "generator.inference_engine.external_server_urls=['http://10.0.0.3:8000']",
        "trainer.strategy=megatron",
        "trainer.policy.megatron_config.tensor_model_parallel_size=4",
        "trainer.policy.megatron_config.context_parallel_size=2",
    )
    assert stack.value("engine.url") == "http://10.0.0.3:8000"
    assert "engine.name" not in stack.values and "engine.logprobs_mode" not in stack.values
    assert stack.value("reference.fsdp") is False and "reference.dtype" not in stack.values
    assert stack.value("reference.tensor_parallel_size") == 4
    assert unmirrored(stack) == {"trainer.policy.megatron_config.context_parallel_size": 2}


def test_refusals(tmp_path: Path):
    with pytest.raises(ConfigError, match="'\\+' overrides"):
        read("skyrl", "+trainer.foo=1")
    script = tmp_path / "train.sh"
    script.write_text("python train.py trainer.epochs=1\n")
    with pytest.raises(ConfigError, match="no `-m skyrl.train.entrypoints.main_base`"):
        read("skyrl", str(script))


@pytest.mark.parametrize("script", ["run_gsm8k.sh", "run_lcb.sh", "run_dapo_gsm8k.sh"])
def test_written_spec_loads(script: str, tmp_path: Path):
    spec, text = written_spec("skyrl", tmp_path, script)
    assert spec.sampling.n == 5
    assert "config.py" in text
