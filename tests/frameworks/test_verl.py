"""verl's own example configs (tests/frameworks/configs/verl, at b178a3c) read as verl reads them."""

from __future__ import annotations

import pytest
from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

from mismatch_probe.errors import ConfigError

# verl's defaults at b178a3c, for what an example leaves unset (rollout.yaml, fsdp.yaml, ...)
VERL_DEFAULTS = {
    "engine.dtype": "bfloat16",
    "engine.tensor_parallel_size": 2,
    "engine.data_parallel_size": 1,
    "engine.pipeline_parallel_size": 1,
    "engine.gpu_memory_utilization": 0.5,
    "engine.enforce_eager": False,
    "engine.max_num_seqs": 256,
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "sampling.top_k": -1,
    "sampling.n": 1,
    "sampling.max_tokens": 512,
    "reference.dtype": "float32",
    "reference.fsdp": True,
    "reference.fsdp_param_dtype": "bfloat16",
    "reference.sequence_parallel_size": 1,
    "reference.packing": True,
    "reference.attn_implementation": "flash_attention_2",
    "reference.logprobs": "temperature",
}
VLLM_ONLY = {
    "engine.chunked_prefill": True,
    "engine.prefix_caching": True,
    "engine.max_num_batched_tokens": 8192,
    "engine.logprobs_mode": "processed",
}


def test_grpo_qwen2_7b_on_vllm():
    stack = read("verl", "run_qwen2-7b.sh")
    check_values(
        stack,
        {
            **VERL_DEFAULTS,
            **VLLM_ONLY,
            "engine.name": "vllm",
            "engine.gpu_memory_utilization": 0.6,
            "sampling.n": 5,
            "sampling.max_tokens": 1024,
        },
    )
    assert from_user(stack) == {
        "engine.name",
        "engine.tensor_parallel_size",
        "engine.gpu_memory_utilization",
        "sampling.n",
        "sampling.max_tokens",
        "reference.packing",
    }
    assert stack.model.value == "Qwen/Qwen2-7B-Instruct"
    assert stack.dataset.value == "$HOME/data/gsm8k/train.parquet"  # as the script has it; init expands it
    assert stack.engine_pin.startswith("vllm>=0.8.5,<=0.12.0")
    assert unmirrored(stack) == {}
    # vLLM < 0.32 with n = 5 samples sharing each prompt: cascade attention; and of the vLLMs verl's
    # pin allows (0.8.5 to 0.12.0) the in-process adapter runs only 0.12.0 (the others lack flat_logprobs)
    assert risk_ids(stack) == {"cascade-attention", "engine-version"}


def test_ppo_qwen2_7b_on_sglang_with_two_train_files():
    stack = read("verl", "run_qwen2-7b_sglang_seq_balance.sh")
    check_values(
        stack,
        {
            **VERL_DEFAULTS,
            "engine.name": "sglang",
            "engine.attention_backend": "fa3",  # verl's SGLang default (async_sglang_server.py:235,276)
            "sampling.max_tokens": 4096,
        },
    )
    # the shell variables and the quoted Hydra list resolve as bash and Hydra would
    assert stack.dataset.value == ["$HOME/data/gsm8k/train.parquet", "$HOME/data/math/train.parquet"]
    assert stack.engine_pin.startswith("sglang[srt,openai]==0.5.6")
    # SGLang: no cascade attention; the SGLang engine finding that affects every model
    assert risk_ids(stack) == {"engine-finding:sglang-last-vocab-id-reported-as-0"}


def test_rollout_correction_example_maps_sequence_is_and_lists_what_it_cannot():
    stack = read("verl", "run_with_rollout_corr.sh")
    assert stack.values["corrections.seq_tis"].value == 2.0
    assert "corrections.token_tis" not in stack.values
    assert stack.model.value == "Qwen/Qwen2.5-7B"  # ${MODEL_PATH:-"Qwen/Qwen2.5-7B"} of an unset MODEL_PATH
    assert stack.values["sampling.max_tokens"].value == 4096  # through ${max_response_length}
    assert unmirrored(stack) == {
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "algorithm.rollout_correction.bypass_mode": True,
        "algorithm.rollout_correction.rollout_is_batch_normalize": True,
        "algorithm.rollout_correction.loss_type": "reinforce",
    }


def test_hydra_yaml_and_overrides_in_order():
    stack = read(
        "verl",
        "gsm8k_multiturn_grpo.yaml",
        "actor_rollout_ref.rollout.n=8",
        "+actor_rollout_ref.rollout.temperature=0.7",
    )
    assert stack.values["engine.name"].value == "sglang"
    assert stack.values["sampling.n"].value == 8 and stack.values["sampling.n"].origins[0].file == "command line"
    assert stack.values["sampling.temperature"].value == 0.7
    assert stack.values["sampling.max_tokens"].value == 1024
    assert unmirrored(stack).keys() == {
        "actor_rollout_ref.rollout.multi_turn.enable",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    }


def test_greedy_when_do_sample_is_off_and_cascade_off_clears_the_risk():
    stack = read(
        "verl",
        "run_qwen2-7b.sh",
        "actor_rollout_ref.rollout.do_sample=False",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_cascade_attn=True",
    )
    assert stack.values["sampling.temperature"].value == 0.0
    assert stack.values["engine.cascade_attn"].value is False
    assert "cascade-attention" not in risk_ids(stack)


def test_top_p_below_one_renormalised_on_the_engine_only():
    stack = read("verl", "run_qwen2-7b.sh", "actor_rollout_ref.rollout.top_p=0.9")
    # vLLM's processed log-probs are renormalised over the nucleus; verl's actor scores log_softmax(logits / T)
    assert "truncated-sampling" in risk_ids(stack)
    assert "truncated-sampling" not in risk_ids(read("verl", "run_qwen2-7b.sh"))


def test_rollout_name_is_required_as_verl_requires_it(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.max_response_length=8\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.name"):
        read("verl", script)


def test_the_written_spec_loads_and_keeps_each_origin(tmp_path):
    spec, text = written_spec("verl", tmp_path, "run_qwen2-7b.sh", settings={"engine.tensor_parallel_size": 1})
    assert spec.engine.name == "vllm" and spec.sampling.n == 5 and spec.sampling.max_tokens == 1024
    assert spec.engine.tensor_parallel_size == 1  # this machine's
    assert spec.stack.framework == "verl" and [r.id for r in spec.stack.risks] == [
        "engine-version",
        "cascade-attention",
    ]
    line = next(ln for ln in text.splitlines() if ln.startswith("tensor_parallel_size"))
    assert "init --set" in line and "verl: 2 from" in line and "tensor_model_parallel_size" in line
    line = next(ln for ln in text.splitlines() if ln.startswith('dtype = "bfloat16"'))
    assert "verl default (verl/trainer/config/rollout/rollout.yaml:29 @ b178a3c)" in line
    # [stack] changes no fingerprint: the same spec without it fingerprints the same
    assert spec.fingerprint() == spec.model_copy(update={"stack": None}).fingerprint()


def test_an_input_with_a_newline_still_writes_a_spec_that_loads(tmp_path):
    spec, _ = written_spec("verl", tmp_path, "run_qwen2-7b.sh", "+actor_rollout_ref.rollout.custom='a\nb'")
    assert spec.stack.config[-1] == "+actor_rollout_ref.rollout.custom='a\nb'"
