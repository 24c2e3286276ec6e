"""prime-rl's own rl configs (tests/frameworks/configs/prime-rl, at 559b447) read as its `rl`
entrypoint reads them: TOML files, component files under their table, --key value overrides."""

from __future__ import annotations

from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

# prime-rl's defaults at 559b447 (configs/inference.py, orchestrator.py, trainer.py) and its code's
DEFAULTS = {
    "engine.name": "vllm",
    "engine.dtype": "auto",
    "engine.enforce_eager": False,
    "engine.tensor_parallel_size": 1,
    "engine.data_parallel_size": 1,
    "engine.gpu_memory_utilization": 0.9,
    "engine.logprobs_mode": "processed",  # set unless given (inference.py:611-613)
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,  # fixed (orchestrator.py:62)
    "reference.fsdp": True,
    "reference.fsdp_param_dtype": "bfloat16",
    "reference.dtype": "float32",  # optimization_dtype
    "reference.fsdp_reduce_dtype": "float32",
    "reference.sequence_parallel_size": 1,
    "reference.logprobs": "temperature",
    "reference.logits_fp32": False,  # bf16 matmul, float32 after (lm_head.py:134-135)
}


def test_reverse_text_default_fp32_head_is_one_sided():
    stack = read("prime-rl", "@", "reverse-text-rl.toml")
    check_values(stack, {**DEFAULTS, "sampling.n": 16, "sampling.max_tokens": 128})
    assert from_user(stack) == {"sampling.n", "sampling.max_tokens"}
    assert stack.model.value == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert stack.engine_pin.startswith("vllm>=0.26.0")
    assert stack.fact("engine_lm_head_fp32") is True
    assert "inference.py:466" in stack.facts["engine_lm_head_fp32"].origin.default_at
    assert "patches.py:658-719" in stack.fact("evidence:one-sided-fp32-head")
    assert unmirrored(stack) == {}
    assert risk_ids(stack) == {"one-sided-fp32-head", "cascade-attention"}


def test_wordle_with_the_fp32_head_off_has_no_head_risk():
    stack = read("prime-rl", "wordle-rl.toml", "--inference.enable-fp32-lm-head", "false")
    check_values(stack, {**DEFAULTS, "sampling.n": 8, "sampling.max_tokens": 1024})
    assert stack.fact("engine_lm_head_fp32") is False
    assert "one-sided-fp32-head" not in risk_ids(stack)
    assert "one-sided-fp32-head" in risk_ids(read("prime-rl", "wordle-rl.toml"))


def test_overrides_and_component_files(tmp_path):
    infer = tmp_path / "infer.toml"
    infer.write_text('[vllm]\ndtype = "bfloat16"\nenable_prefix_caching = false\ndisable_cascade_attn = true\n')
    stack = read(
        "prime-rl",
        "reverse-text-rl.toml",
        "--inference",
        f"@{infer}",
        "--orchestrator.group-size=4",
        "--trainer.model.cp",
        "2",
        "--inference.vllm.max-num-seqs",
        "64",
    )
    values = {k: v.value for k, v in stack.values.items()}
    assert values["engine.dtype"] == "bfloat16" and values["engine.prefix_caching"] is False
    assert values["engine.cascade_attn"] is False and values["engine.max_num_seqs"] == 64
    assert values["sampling.n"] == 4 and stack.values["sampling.n"].origins[0].file == "command line"
    assert "reference.sequence_parallel_size" not in values  # ring CP by default
    assert unmirrored(stack) == {"trainer.model.cp": 2}
    assert "cascade-attention" not in risk_ids(stack)


def test_the_written_spec_loads(tmp_path):
    spec, _ = written_spec("prime-rl", tmp_path, "reverse-text-rl.toml")
    assert spec.engine.name == "vllm" and spec.sampling.n == 16 and spec.sampling.max_tokens == 128
    assert {r.id for r in spec.stack.risks} == {"one-sided-fp32-head", "cascade-attention"}
