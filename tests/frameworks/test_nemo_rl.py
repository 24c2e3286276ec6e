"""NeMo-RL's own configs (tests/frameworks/configs/nemo-rl, at 7ea279a) read as its load_config reads
them: the defaults: chain first, then the file, then the Hydra overrides."""

from __future__ import annotations

import pytest
from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

from mismatch_probe.errors import ConfigError

BASE = "grpo_math_1B.yaml"
SGLANG = "grpo_math_1B_sglang.yaml"
TP1 = "recipes/llm/grpo-llama3.2-1b-instruct-1n8g-fsdp2tp1.v3.yaml"
TOPK = "recipes/llm/grpo-llama3.2-1b-instruct-1n8g-fsdp2tp2-temp0.8-topp0.9-topk50.yaml"

# grpo_math_1B.yaml's sampling and DTensor trainer (its lines 4, 136-147, 332, 370-373) and the code's
SAMPLING = {
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "sampling.top_k": -1,  # null top-k (vllm_worker.py:648)
    "sampling.n": 16,
    "sampling.max_tokens": 512,  # ${policy.max_total_sequence_length}
}
TRAINER = {
    "reference.dtype": "float32",  # master weights (setup.py:330)
    "reference.fsdp": True,
    "reference.fsdp_param_dtype": "bfloat16",  # policy.precision
    "reference.fsdp_reduce_dtype": "float32",
    "reference.fsdp_output_dtype": "float32",
    "reference.tensor_parallel_size": 1,
    "reference.packing": True,
    "reference.attn_implementation": "flash_attention_2",  # packed, no CP (setup.py:321-325)
    "reference.logprobs": "processed",
    "reference.logits_fp32": False,
}
VLLM = {
    "engine.name": "vllm",
    "engine.dtype": "bfloat16",  # vllm_cfg.precision: ${policy.precision}
    "engine.tensor_parallel_size": 1,
    "engine.pipeline_parallel_size": 1,
    "engine.gpu_memory_utilization": 0.6,
    "engine.enforce_eager": False,
    "engine.max_model_len": 512,
    "engine.kv_cache_dtype": "auto",
    "engine.logprobs_mode": "processed",
    "engine.prefix_caching": True,  # unset: on for compute capability >= 8 (vllm_worker.py:84-88)
}


def test_base_config_named_directly():
    stack = read("nemo-rl", BASE)
    check_values(stack, {**VLLM, **SAMPLING, **TRAINER})
    # every key it sets is the user's file; the code's behaviours are not
    assert from_user(stack) == set(VLLM) - {"engine.prefix_caching"} | set(SAMPLING) | {
        "reference.fsdp_param_dtype",
        "reference.tensor_parallel_size",
        "reference.packing",
        "reference.attn_implementation",
    }
    assert stack.model.value == "Qwen/Qwen2.5-1.5B"
    assert stack.dataset.value == "OpenMathInstruct-2"
    assert stack.engine_pin.startswith("vllm==0.25.1")
    # a key at NeMo-RL's own default (force_on_policy_ratio false, expert parallel 1) is not listed
    assert unmirrored(stack) == {}
    # vLLM 0.25 leaves cascade attention on, and 16 samples share each prompt
    assert risk_ids(stack) == {"cascade-attention"}


def test_sglang_config_inherits_the_base_through_defaults():
    stack = read("nemo-rl", SGLANG)
    check_values(
        stack,
        {
            **SAMPLING,
            **TRAINER,
            "engine.name": "sglang",
            "engine.dtype": "bfloat16",  # sglang_cfg.dtype: ${policy.precision}
            "engine.tensor_parallel_size": 1,
            "engine.pipeline_parallel_size": 1,
            "engine.data_parallel_size": 1,
            "engine.gpu_memory_utilization": 0.6,
            "engine.enforce_eager": False,
            "engine.max_model_len": 512,
        },
    )
    # what the file itself sets; the rest is inherited, cited at the base's line
    assert from_user(stack) == {
        "engine.name",
        "engine.tensor_parallel_size",
        "engine.pipeline_parallel_size",
        "engine.data_parallel_size",
        "engine.gpu_memory_utilization",
        "engine.enforce_eager",
        "engine.max_model_len",
    }
    temperature = stack.values["sampling.temperature"].origins[0]
    assert not temperature.from_user and temperature.default_at.endswith("grpo_math_1B.yaml:371")
    assert stack.engine_pin.startswith("sglang==0.5.12.post1")
    assert unmirrored(stack) == {
        "policy.generation.sglang_cfg.ep_size": 1,
        "policy.generation.sglang_cfg.disable_piecewise_cuda_graph": True,
    }
    assert risk_ids(stack) == {"engine-finding:sglang-last-vocab-id-reported-as-0"}


def test_recipe_two_levels_deep_truncated_sampling():
    stack = read("nemo-rl", TOPK)
    expected = {**VLLM, **SAMPLING, **TRAINER}
    expected.update(
        {
            "sampling.temperature": 0.8,
            "sampling.top_p": 0.9,
            "sampling.top_k": 50,
            "reference.tensor_parallel_size": 2,
            "reference.packing": False,  # the parent recipe's
        }
    )
    del expected["reference.attn_implementation"]  # unpacked, no CP: transformers' own choice
    check_values(stack, expected)
    assert from_user(stack) == {
        "sampling.temperature",
        "sampling.top_p",
        "sampling.top_k",
        "reference.tensor_parallel_size",
    }
    packing = stack.values["reference.packing"].origins[0]
    assert packing.default_at.endswith("grpo-llama3.2-1b-instruct-1n8g-fsdp2tp1.v3.yaml:13")
    assert stack.model.value == "meta-llama/Llama-3.2-1B-Instruct"
    assert unmirrored(stack) == {}
    # both sides renormalise over top-k / top-p: NeMo-RL's trainer filters as the engine samples
    assert risk_ids(stack) == {"cascade-attention", "truncated-sampling"}
    assert "truncated-sampling" not in risk_ids(read("nemo-rl", TP1))


def test_config_flag_and_overrides_in_order():
    stack = read(
        "nemo-rl",
        "--config",
        TP1,
        "grpo.num_generations_per_prompt=4",
        "policy.max_total_sequence_length=2048",
        "++policy.generation.vllm_kwargs.disable_cascade_attn=true",
        "policy.generation.vllm_cfg.enable_prefix_caching=false",
    )
    assert stack.values["sampling.n"].value == 4
    assert stack.values["sampling.n"].origins[0].file == "command line"
    assert stack.values["sampling.max_tokens"].value == 512  # the recipe sets max_new_tokens itself
    assert stack.values["engine.prefix_caching"].value is False
    assert stack.values["engine.cascade_attn"].value is False
    assert "cascade-attention" not in risk_ids(stack)


@pytest.mark.parametrize(
    ("kind", "ratio_min", "expected"),
    [
        ("tis", None, {"corrections.token_tis": 2.0}),
        ("icepop", 0.5, {"corrections.token_mask_low": 0.5, "corrections.token_mask_high": 2.0}),
        ("seq-mask-tis", 0.0, {"corrections.geo_eps": 1.0}),
    ],
)
def test_truncated_importance_sampling_maps_by_type(kind, ratio_min, expected):
    stack = read(
        "nemo-rl",
        BASE,
        "loss_fn.use_importance_sampling_correction=true",
        f"loss_fn.truncated_importance_sampling_type={kind}",
        "loss_fn.truncated_importance_sampling_ratio=2.0",
        f"loss_fn.truncated_importance_sampling_ratio_min={'null' if ratio_min is None else ratio_min}",
    )
    assert {k: v.value for k, v in stack.values.items() if k.startswith("corrections.")} == expected


def test_asymmetric_sequence_bounds_and_megatron_are_listed():
    stack = read(
        "nemo-rl",
        TP1,
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
        "loss_fn.truncated_importance_sampling_ratio=1.01",
        "loss_fn.truncated_importance_sampling_ratio_min=0.9",
        "policy.megatron_cfg.enabled=true",
        "policy.megatron_cfg.tensor_model_parallel_size=2",
    )
    assert "corrections.geo_eps" not in stack.values
    assert stack.values["reference.tensor_parallel_size"].value == 2
    assert "reference.fsdp" not in stack.values
    assert unmirrored(stack).keys() == {
        "loss_fn.truncated_importance_sampling_ratio_min",
        "policy.megatron_cfg.enabled",
    }


def test_a_missing_defaults_file_names_where_it_was_looked_for(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("defaults: ../../grpo_math_1B.yaml\n")
    with pytest.raises(ConfigError, match=r"defaults file \.\./\.\./grpo_math_1B\.yaml"):
        read("nemo-rl", child)


def test_override_section_replaces_the_parent(tmp_path):
    (tmp_path / "base.yaml").write_text("policy:\n  generation:\n    temperature: 0.5\n    top_p: 0.5\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: base.yaml\npolicy:\n  generation:\n    _override_: true\n    top_k: 7\n")
    stack = read("nemo-rl", child)
    # the parent's generation table is gone, the base config's defaults with it (NeMo-RL then has no
    # temperature at all)
    assert "sampling.temperature" not in stack.values and "sampling.top_p" not in stack.values
    assert stack.values["sampling.top_k"].value == 7


def test_the_written_spec_loads(tmp_path):
    spec, text = written_spec("nemo-rl", tmp_path, TOPK)
    assert spec.engine.name == "vllm" and spec.sampling.n == 16 and spec.sampling.top_k == 50
    assert spec.stack.framework == "nemo-rl"
    assert {r.id for r in spec.stack.risks} == {"cascade-attention", "truncated-sampling"}
    line = next(ln for ln in text.splitlines() if ln.startswith("top_p"))
    assert "topk50.yaml: policy.generation.top_p" in line
