"""open-r1's GRPO recipes (tests/frameworks/configs/trl) read as TRL's TrlParser reads a GRPOConfig,
with TRL's defaults at f2cd577."""

from __future__ import annotations

from pathlib import Path

import pytest
from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

from mismatch_probe.errors import ConfigError

# what TRL's colocated engine and its trainer do whatever the recipe says (f2cd577)
COLOCATE = {
    "engine.name": "vllm",
    "engine.tensor_parallel_size": 1,  # vllm_tensor_parallel_size
    "engine.gpu_memory_utilization": 0.3,
    "engine.max_num_batched_tokens": 4096,  # vllm_generation.py:363
    "engine.dtype": "auto",  # LLM(...) passes no dtype
    "engine.logprobs_mode": "processed",  # vllm_generation.py:365
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "sampling.top_k": 0,
    "sampling.n": 8,
    "sampling.max_tokens": 512,
    "reference.dtype": "bfloat16",  # float32 weights under bf16 autocast (bf16 None -> True)
    "reference.attn_implementation": "auto",
    "reference.logits_fp32": False,
    "reference.logprobs": "temperature",  # grpo_trainer.py:1519
    "reference.packing": False,
    "corrections.seq_mis": 3.0,  # sequence_mask at clip_max 3.0
}


def test_open_r1_demo_recipe():
    stack = read("trl", "config_demo.yaml")
    check_values(
        stack,
        {
            **COLOCATE,
            "engine.max_num_seqs": 64,  # per_device_train_batch_size 16 x TP 1 x gradient_accumulation_steps 4
            "sampling.n": 16,
            "sampling.max_tokens": 1024,
            "reference.attn_implementation": "flash_attention_2",
        },
    )
    assert from_user(stack) == {"sampling.n", "sampling.max_tokens", "reference.attn_implementation"}
    assert stack.values["reference.dtype"].origins[1].key == "torch_dtype"
    assert str(stack.values["sampling.temperature"].origins[0]).startswith(
        "temperature: trl default (trl/trainer/grpo_config.py:522 @ f2cd577)"
    )
    assert stack.model.value == "Qwen/Qwen2.5-1.5B-Instruct"
    assert stack.dataset.value == "open-r1/OpenR1-Math-220k"
    assert stack.prompt_key.value == "problem"
    assert stack.engine_pin == "vllm>=0.17.0,<=0.25.1 (pyproject.toml:83)"
    assert unmirrored(stack) == {}
    # processed engine log-probs and a trainer at logits / T: no temperature risk; vLLM <= 0.25 with
    # 16 samples per prompt: cascade attention
    assert risk_ids(stack) == {"cascade-attention"}


def test_open_r1_codeforces_recipe():
    stack = read("trl", "config_codeforces.yaml")
    check_values(
        stack,
        {
            **COLOCATE,
            "engine.gpu_memory_utilization": 0.7,
            "engine.max_num_seqs": 128,  # 4 x 1 x 32
            "sampling.temperature": 0.7,
            "sampling.n": 16,
            "sampling.max_tokens": 8192,
            "reference.attn_implementation": "flash_attention_2",
        },
    )
    assert "sampling.temperature" in from_user(stack)
    assert unmirrored(stack) == {"vllm_device": "auto"}  # gone from GRPOConfig at f2cd577
    assert stack.prompt_key.value == "prompt"
    assert risk_ids(stack) == {"cascade-attention"}


def test_command_line_overrides_win(tmp_path: Path):
    stack = read(
        "trl",
        "--config",
        "config_demo.yaml",
        "--top-p",
        "0.9",
        "--vllm_importance_sampling_mode=token_mask",
        "--vllm_importance_sampling_clip_min",
        "0.5",
        "--cast_lm_head_to_fp32",
        "--dtype",
        "bfloat16",
    )
    assert stack.value("sampling.top_p") == 0.9
    assert stack.values["sampling.top_p"].origins[0].file == "command line"
    assert stack.value("corrections.token_mask_high") == 3.0
    assert stack.value("corrections.token_mask_low") == 0.5
    assert "corrections.seq_mis" not in stack.values
    assert stack.value("reference.logits_fp32") is True
    # top-p: vLLM's processed log-probs are renormalised, TRL's trainer's are not; and the head
    assert risk_ids(stack) == {"cascade-attention", "truncated-sampling", "one-sided-fp32-head"}


@pytest.mark.parametrize(
    ("mode", "key"),
    [("token_truncate", "corrections.token_tis"), ("sequence_truncate", "corrections.seq_tis")],
)
def test_importance_sampling_modes(mode: str, key: str):
    stack = read(
        "trl", "config_demo.yaml", f"--vllm_importance_sampling_mode={mode}", "--vllm_importance_sampling_cap=2"
    )
    assert stack.value(key) == 2.0  # the deprecated cap replaces clip_max
    assert not {k for k in stack.values if k.startswith("corrections.")} - {key}
    off = read("trl", "config_demo.yaml", "--vllm_importance_sampling_correction", "false")
    assert not [k for k in off.values if k.startswith("corrections.")]


def test_colocate_reload_with_sleep_mode_only():
    stack = read("trl", "config_demo.yaml", "--vllm_enable_sleep_mode", "true")
    assert "colocate-reload" in risk_ids(stack)
    assert "reload_weights" in stack.fact("colocate_reload_weights")
    assert unmirrored(stack) == {"vllm_enable_sleep_mode": True}
    assert "colocate-reload" not in risk_ids(read("trl", "config_demo.yaml"))
    server = read("trl", "config_demo.yaml", "--vllm_enable_sleep_mode", "true", "--vllm_mode", "server")
    assert "colocate-reload" not in risk_ids(server)


def test_server_mode_points_at_trl_vllm_serve():
    stack = read("trl", "config_demo.yaml", "--vllm_mode", "server", "--vllm_server_host", "10.0.0.2")
    assert stack.value("engine.api") == "trl"
    assert stack.value("engine.url") == "http://10.0.0.2:8000"
    assert stack.value("engine.logprobs_mode") == "processed"  # vllm_serve.py:361
    # the server's own flags are not in the config
    assert not {"engine.name", "engine.tensor_parallel_size", "engine.dtype", "engine.max_num_seqs"} & set(stack.values)


def test_without_vllm_the_engine_is_not_mirrored(tmp_path: Path):
    cfg = tmp_path / "grpo.json"
    cfg.write_text('{"model_name_or_path": "Qwen/Qwen3-0.6B", "use_vllm": false, "temperature": 0.9}')
    stack = read("trl", str(cfg))
    assert "engine.name" not in stack.values and "corrections.seq_mis" not in stack.values
    assert unmirrored(stack) == {"use_vllm": False}
    assert stack.value("reference.dtype") == "bfloat16"


def test_refuses_a_non_config_file(tmp_path: Path):
    script = tmp_path / "train.sh"
    script.write_text("trl grpo --config x.yaml\n")
    with pytest.raises(ConfigError, match="not a GRPOConfig YAML or JSON file"):
        read("trl", str(script))


@pytest.mark.parametrize("config", ["config_demo.yaml", "config_codeforces.yaml"])
def test_written_spec_loads(config: str, tmp_path: Path):
    spec, text = written_spec("trl", tmp_path, config)
    assert spec.sampling.n == 16
    assert "grpo_config.py" in text
