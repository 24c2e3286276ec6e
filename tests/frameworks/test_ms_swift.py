"""ms-swift's own GRPO launch scripts (tests/frameworks/configs/ms-swift, at 3602360) read as
``swift rlhf`` and ``swift rollout`` read them."""

from __future__ import annotations

import json

import pytest
from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

from mismatch_probe.errors import ConfigError

COLOCATE = "vllm_72b_4gpu.sh"
SERVER = "server_multi_node.sh"

# what every GRPO run with vLLM has, set or defaulted (args_mixin.py, rlhf_args.py, template_args.py)
SWIFT = {
    "engine.name": "vllm",
    "engine.enforce_eager": False,
    "engine.cascade_attn": True,  # --vllm_disable_cascade_attn False (args_mixin.py:51)
    "engine.logprobs_mode": "processed",
    "sampling.temperature": 0.9,
    "sampling.top_p": 1.0,
    "sampling.top_k": -1,
    "sampling.n": 8,
    "sampling.max_tokens": 512,
    "reference.packing": False,
    "reference.sequence_parallel_size": 1,
    "reference.logprobs": "temperature",
}


def test_colocate_72b_lora():
    stack = read("ms-swift", COLOCATE)
    check_values(
        stack,
        {
            **SWIFT,
            "engine.dtype": "bfloat16",
            "engine.tensor_parallel_size": 4,
            "engine.gpu_memory_utilization": 0.55,
            "engine.max_model_len": 2048,
            "engine.prefix_caching": True,  # the trainer's own default (args_mixin.py:173)
            "engine.distributed_executor_backend": "external_launcher",
            "sampling.temperature": 1.0,
            "sampling.top_k": 80,
            "sampling.n": 4,
            "sampling.max_tokens": 1024,
            "reference.dtype": "bfloat16",
        },
    )
    assert from_user(stack) >= {
        "engine.tensor_parallel_size",
        "sampling.top_k",
        "sampling.max_tokens",
        "reference.dtype",
    }
    assert "args_mixin.py:173 @ 3602360" in stack.values["engine.prefix_caching"].source
    assert stack.model.value == "Qwen/Qwen2.5-72B-Instruct"
    # the '#10000' (sample that many) is the word's, not a comment
    assert stack.dataset.value == "AI-MO/NuminaMath-TIR#10000"
    assert stack.engine_pin.startswith("vllm>=0.5.1")
    assert unmirrored(stack) == {}
    # top-k 80: vLLM's processed log-probs renormalise over the top 80, the trainer's logits / T do
    # not; 4 samples a prompt under vLLM's cascade attention
    assert risk_ids(stack) == {"truncated-sampling", "cascade-attention"}


def test_server_mode_reads_the_swift_rollout_command():
    stack = read("ms-swift", SERVER)
    check_values(
        stack,
        {
            **SWIFT,
            "engine.tensor_parallel_size": 2,  # swift rollout --vllm_tensor_parallel_size 2
            "engine.data_parallel_size": 2,
            "engine.pipeline_parallel_size": 1,
            "engine.gpu_memory_utilization": 0.9,
            "engine.max_num_seqs": 256,  # VllmArguments' default for swift rollout (args_mixin.py:41)
            "sampling.n": 4,
            "sampling.max_tokens": 2048,
        },
    )
    tp = stack.values["engine.tensor_parallel_size"].origins[0]
    assert tp.key == "swift rollout --vllm_tensor_parallel_size" and tp.from_user
    assert unmirrored(stack) == {
        "--vllm_server_host": ["<node1_ip>", "<node2_ip>"],
        "--vllm_server_port": ["<node1_port>", "<node2_port>"],
    }
    assert risk_ids(stack) == {"cascade-attention"}


def test_server_mode_without_its_rollout_command_takes_swift_rollouts_defaults():
    stack = read("ms-swift", "grpo_7b.sh")
    assert stack.value("engine.tensor_parallel_size") == 1
    assert not stack.values["engine.tensor_parallel_size"].origins[0].from_user
    assert "engine.prefix_caching" not in stack.values  # None: vLLM's own default for swift rollout
    assert (stack.value("sampling.top_p"), stack.value("sampling.top_k")) == (0.9, 50)
    assert "truncated-sampling" in risk_ids(stack)


def test_cascade_attention_off_clears_the_risk():
    stack = read("ms-swift", COLOCATE, "--vllm_disable_cascade_attn", "true")
    assert stack.value("engine.cascade_attn") is False
    assert "cascade-attention" not in risk_ids(stack)
    served = read("ms-swift", SERVER)
    assert "cascade-attention" in risk_ids(served)


def test_rollout_importance_sampling_modes(tmp_path):
    token = read("ms-swift", COLOCATE, "--rollout_importance_sampling_mode", "token_truncate")
    assert token.value("corrections.token_tis") == 2.0  # args_mixin.py:480
    mask = read(
        "ms-swift",
        COLOCATE,
        "--rollout_importance_sampling_mode",
        "token_mask",
        "--rollout-importance-sampling-threshold",  # a dash spelling reads as the underscore one
        "3.0",
    )
    assert mask.value("corrections.token_mask_high") == 3.0 and "corrections.token_tis" not in mask.values
    seq = read("ms-swift", COLOCATE, "--rollout_importance_sampling_mode", "sequence_mask")
    assert not any(k.startswith("corrections.") for k in seq.values)
    assert unmirrored(seq) == {"--rollout_importance_sampling_mode": "sequence_mask"}


def test_without_vllm_the_trainer_generates():
    stack = read("ms-swift", COLOCATE, "--use_vllm", "false", "--vllm_mode", "null")
    assert stack.value("engine.name") == "hf"
    assert "engine.logprobs_mode" not in stack.values and "engine.tensor_parallel_size" not in stack.values


def test_use_vllm_without_a_mode_is_refused(tmp_path):
    args = tmp_path / "args.txt"
    args.write_text("--rlhf_type grpo --use_vllm true\n")
    with pytest.raises(ConfigError, match="--vllm_mode"):
        read("ms-swift", args)


def test_the_written_spec_loads_with_the_system_prompt(tmp_path):
    data = tmp_path / "math.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec, text = written_spec(
        "ms-swift",
        tmp_path,
        COLOCATE,
        "--system",
        "Think step by step.",
        dataset=str(data),
        num_prompts=3,
        settings={"engine.tensor_parallel_size": 1},
    )
    assert spec.engine.name == "vllm" and spec.sampling.top_k == 80 and spec.sampling.max_tokens == 1024
    assert {r.id for r in spec.stack.risks} == {"truncated-sampling", "cascade-attention"}
    assert "ms-swift default (swift/arguments/rlhf_args.py:163 @ 3602360)" not in text  # --num_generations is set
    written = [json.loads(line) for line in (tmp_path / "ms-swift-prompts.jsonl").read_text().splitlines()]
    # the system prompt first; the reference answer (the trailing assistant message) dropped
    assert all(w["messages"][0] == {"role": "system", "content": "Think step by step."} for w in written)
    assert all(w["messages"][-1]["role"] == "user" for w in written)
