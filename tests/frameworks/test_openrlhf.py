"""OpenRLHF's own launch scripts (tests/frameworks/configs/openrlhf, at 3c3be62) read as
``openrlhf.cli.train_ppo_ray`` reads them."""

from __future__ import annotations

import json

from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

PPO = "train_ppo_ray_hybrid_engine.sh"

# what every OpenRLHF run has, set or defaulted (train_ppo_ray.py, vllm_engine.py, actor.py at 3c3be62)
OPENRLHF = {
    "engine.name": "vllm",
    "engine.dtype": "bfloat16",
    "engine.prefix_caching": False,
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "sampling.top_k": -1,
    "reference.dtype": "bfloat16",
    "reference.attn_implementation": "flash_attention_2",
    "reference.tensor_parallel_size": 1,
    "reference.logits_fp32": False,
    "reference.logprobs": "temperature",
}


def test_ppo_hybrid_engine_with_tis():
    stack = read("openrlhf", PPO)
    check_values(
        stack,
        {
            **OPENRLHF,
            "engine.tensor_parallel_size": 2,
            "engine.distributed_executor_backend": "ray",  # TP > 1 (vllm_engine.py:242)
            "engine.enforce_eager": True,
            "engine.gpu_memory_utilization": 0.5,
            "engine.max_model_len": 2048,
            "engine.logprobs_mode": "processed",  # --algo.advantage.is_correction_enable
            "sampling.n": 1,
            "sampling.max_tokens": 2048,  # no --rollout.max_new_tokens: up to --data.max_len
            "reference.packing": True,
            "corrections.token_tis": 5.0,  # tis's high clamp, the default [0.5, 5.0]
        },
    )
    assert from_user(stack) == {
        "engine.tensor_parallel_size",
        "engine.distributed_executor_backend",
        "engine.enforce_eager",
        "engine.gpu_memory_utilization",
        "engine.max_model_len",
        "engine.logprobs_mode",
        "sampling.n",
        "reference.dtype",
        "reference.packing",
    }
    assert "train_ppo_ray.py:258-264 @ 3c3be62" in stack.values["corrections.token_tis"].source
    assert stack.model.value == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert stack.dataset.value == "OpenRLHF/prompt-collection-v0.1"
    assert stack.prompt_key.value == "context_messages" and stack.fact("dataset_shape") == "text-as-chat"
    assert stack.engine_pin.startswith("vllm==0.27.1")
    assert unmirrored(stack) == {"--vllm.num_engines": 4}
    # vLLM 0.27 leaves cascade attention on and OpenRLHF has no switch for it
    assert risk_ids(stack) == {"cascade-attention"}


def test_prorl_icepop_thresholds():
    stack = read("openrlhf", "train_prorlv2_math_hybrid_engine.sh")
    assert stack.value("corrections.token_mask_low") == 0.5
    assert stack.value("corrections.token_mask_high") == 5.0
    assert "corrections.token_tis" not in stack.values
    assert stack.value("sampling.max_tokens") == 8192 and stack.value("engine.max_model_len") == 9216
    assert stack.value("sampling.n") == 16
    assert stack.value("engine.distributed_executor_backend") == "uni"
    assert stack.model.value == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"  # $MODEL_PATH
    assert unmirrored(stack) == {"--vllm.num_engines": 8}


def test_arrays_ring_attention_and_partial_rollouts():
    stack = read("openrlhf", "train_reinforce_baseline_ray_agent_async.sh")
    assert stack.value("sampling.max_tokens") == 64000
    assert stack.value("engine.gpu_memory_utilization") == 0.95
    # icepop at the default thresholds
    assert (stack.value("corrections.token_mask_low"), stack.value("corrections.token_mask_high")) == (0.5, 5.0)
    assert unmirrored(stack) == {
        "--vllm.num_engines": 2,
        "--ds.ring_attn_size": 2,
        "--train.partial_rollout_enable": True,
    }


def test_ring_attention_turns_packing_and_flash_attention_on():
    stack = read(
        "openrlhf", PPO, "--ds.packing_samples=false", "--ds.ring_attn_size", "2", "--ds.attn_implementation", "sdpa"
    )
    # --train.dynamic_batch_enable in the script turns packing back on (train_ppo_ray.py:647-650)
    assert stack.value("reference.packing") is True
    assert stack.value("reference.attn_implementation") == "flash_attention_2"  # train_ppo_ray.py:655-660


def test_without_the_correction_no_processed_log_probs_and_no_thresholds(tmp_path):
    args = tmp_path / "args.txt"
    args.write_text("--vllm.num_engines 1 --rollout.temperature 0.7 --rollout.top_p 0.95 --ds.param_dtype fp16\n")
    stack = read("openrlhf", args)
    assert "engine.logprobs_mode" not in stack.values
    assert not any(k.startswith("corrections.") for k in stack.values)
    assert stack.value("reference.dtype") == "float16" and stack.value("reference.packing") is False
    # vLLM's default raw log-probs against the actor's logits / T, below top-p 1: both risks; and
    # bfloat16 in the engine against float16 in the trainer
    assert {"logprobs-temperature", "truncated-sampling", "precision-differs"} <= risk_ids(stack)


def test_top_p_below_one_against_processed_log_probs():
    stack = read("openrlhf", PPO, "--rollout.top_p", "0.9")
    # vLLM's processed log-probs renormalise over the nucleus; the actor's log_softmax(logits / T) does not
    assert "truncated-sampling" in risk_ids(stack)
    assert "truncated-sampling" not in risk_ids(read("openrlhf", PPO))


def test_seq_mask_tis_maps_to_geo_eps_only_when_symmetric():
    stack = read(
        "openrlhf",
        PPO,
        "--algo.advantage.is_correction_type",
        "seq-mask-tis",
        "--algo.advantage.is_correction_threshold",
        "0.999",
        "1.001",
    )
    assert stack.value("corrections.geo_eps") == 0.001
    asymmetric = read(
        "openrlhf",
        PPO,
        "--algo.advantage.is_correction_type",
        "seq-mask-tis",
        "--algo.advantage.is_correction_threshold",
        "0.5",
        "2.0",
    )
    assert not any(k.startswith("corrections.") for k in asymmetric.values)
    assert unmirrored(asymmetric)["--algo.advantage.is_correction_threshold"] == [0.5, 2.0]


def test_gspo_applies_no_correction():
    stack = read("openrlhf", PPO, "--actor.policy_loss_type", "gspo")
    assert "corrections.token_tis" not in stack.values  # loss.py: only the PPO loss corrects


def test_the_written_spec_loads_with_an_input_template(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i} + {i} = ?"}) + "\n" for i in range(6)))
    spec, text = written_spec(
        "openrlhf",
        tmp_path,
        "train_prorlv2_math_hybrid_engine.sh",
        "--data.apply_chat_template=false",
        "--data.input_key",
        "input",
        "--data.input_template",
        "Question: {} Answer:",
        dataset=str(data),
        num_prompts=3,
        settings={"engine.tensor_parallel_size": 1},
    )
    assert spec.engine.name == "vllm" and spec.sampling.n == 16 and spec.sampling.max_tokens == 8192
    assert spec.corrections.token_mask_high == 5.0
    assert [r.id for r in spec.stack.risks] == ["cascade-attention"]
    assert "openrlhf default (openrlhf/cli/train_ppo_ray.py:399 @ 3c3be62)" in text
    rows = [json.loads(line) for line in (tmp_path / "openrlhf-prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["prompt"].startswith("Question: ") for r in rows)
