"""slime's own launch scripts (tests/frameworks/configs/slime, at 624b824) read as slime reads them."""

from __future__ import annotations

import json

import pytest
from framework_checks import check_values, from_user, read, risk_ids, unmirrored, written_spec

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.risks import find_risks

SCRIPT = "run-qwen3-4B.sh"
SGLANG_FINDING = "engine-finding:sglang-last-vocab-id-reported-as-0"  # SGLang, every model

# what every slime run has, set or defaulted (slime's arguments.py, loss.py at 624b824)
SLIME = {
    "engine.name": "sglang",
    "sampling.temperature": 1.0,
    "sampling.top_p": 1.0,
    "sampling.top_k": -1,
    "reference.dtype": "bfloat16",
    "reference.logits_fp32": False,
    "reference.logprobs": "temperature",
}


def test_qwen3_4b_grpo():
    stack = read("slime", SCRIPT)
    check_values(
        stack,
        {
            **SLIME,
            "engine.tensor_parallel_size": 2,  # --rollout-num-gpus-per-engine 2
            "engine.gpu_memory_utilization": 0.7,
            "sampling.n": 8,
            "sampling.max_tokens": 8192,
            "reference.tensor_parallel_size": 2,
        },
    )
    assert from_user(stack) == {
        "engine.tensor_parallel_size",
        "engine.gpu_memory_utilization",
        "sampling.temperature",  # --rollout-temperature 1
        "sampling.n",
        "sampling.max_tokens",
        "reference.tensor_parallel_size",
    }
    assert "arguments.py:348-350 @ 624b824" in stack.values["sampling.top_p"].source
    assert "loss.py:535" in stack.values["reference.logits_fp32"].source
    assert stack.model.value == "/root/Qwen3-4B"
    assert stack.dataset.value == "/root/dapo-math-17k/dapo-math-17k.jsonl"
    assert stack.prompt_key.value == "prompt"
    assert stack.fact("dataset_shape") == "text-as-chat"  # --apply-chat-template
    assert stack.engine_pin.startswith("slimerl/sglang:v0.5.15.post1")
    # Megatron's sequence parallelism and attention kernels; CP, PP and EP of 1 are no parallelism
    assert unmirrored(stack) == {"--sequence-parallel": True, "--attention-backend": "flash"}
    assert risk_ids(stack) == {SGLANG_FINDING}


def test_custom_tis_function_is_not_mirrored_and_context_parallelism_is_listed():
    stack = read("slime", "run-qwen3-4b-mis.sh")
    assert stack.value("engine.tensor_parallel_size") == 1
    # --use-tis with a custom TIS function: its thresholds are the function's, not --tis-clip
    assert "corrections.token_tis" not in stack.values
    assert unmirrored(stack) == {
        "--sequence-parallel": True,
        "--context-parallel-size": 2,
        "--attention-backend": "flash",
        "--custom-config-path": "examples/train_infer_mismatch_helper/mis.yaml",
        "--custom-tis-function-path": "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp",
    }


def test_vanilla_tis_maps_its_clip():
    stack = read("slime", SCRIPT, "--use-tis", "--tis-clip", "3.0")
    assert stack.value("corrections.token_tis") == 3.0
    assert stack.values["corrections.token_tis"].origins[0].file == "command line"
    default_clip = read("slime", SCRIPT, "--use-tis")
    assert default_clip.value("corrections.token_tis") == 2.0  # arguments.py:1066-1071
    assert "corrections.token_tis" not in read("slime", SCRIPT).values


def test_deterministic_inference_and_attention_backend():
    stack = read("slime", "run-qwen2.5-0.5B-reproducibility.sh")
    check_values(
        stack,
        {
            **SLIME,
            "engine.tensor_parallel_size": 1,
            "engine.gpu_memory_utilization": 0.7,
            "engine.attention_backend": "flashinfer",
            "engine.batch_invariant": True,
            "sampling.n": 8,
            "sampling.max_tokens": 1024,
            "reference.tensor_parallel_size": 1,
        },
    )
    assert stack.prompt_key.value == "messages" and stack.dataset.value == "/root/gsm8k/train.parquet"
    assert risk_ids(stack) == {SGLANG_FINDING}


def test_top_p_below_one_is_renormalised_by_the_trainer():
    stack = read("slime", SCRIPT, "--rollout-top-p=0.9")
    assert stack.value("sampling.top_p") == 0.9
    assert stack.fact("trainer_renormalizes_truncation") is True
    assert "truncated-sampling" in risk_ids(stack)
    risk = next(r for r in find_risks(stack) if r.id == "truncated-sampling")
    assert "loss.py:83-93,556-578" in risk.evidence
    assert read("slime", SCRIPT).fact("trainer_renormalizes_truncation") is False
    assert "truncated-sampling" not in risk_ids(read("slime", SCRIPT))


def test_fp32_lm_head_on_the_engine_only():
    stack = read("slime", SCRIPT, "--sglang-enable-fp32-lm-head")
    assert stack.value("engine.logits_fp32") is True and stack.value("reference.logits_fp32") is False
    assert "one-sided-fp32-head" in risk_ids(stack)
    assert "one-sided-fp32-head" not in risk_ids(read("slime", SCRIPT))


def test_fp16_sets_both_sides_and_sglang_switches(tmp_path):
    args = tmp_path / "args.txt"  # the arguments pasted into a file, no train.py in it
    args.write_text(
        "--fp16 --rollout-num-gpus-per-engine 4 --sglang-pp-size 2 --sglang-disable-cuda-graph\n"
        "--sglang-disable-radix-cache --sglang-chunked-prefill-size -1 --sglang-dtype bfloat16\n"
    )
    stack = read("slime", args)
    assert stack.value("engine.dtype") == "float16"  # --fp16 wins over --sglang-dtype (sglang_engine.py:571-582)
    assert stack.value("reference.dtype") == "float16"
    assert stack.value("engine.tensor_parallel_size") == 2 and stack.value("engine.pipeline_parallel_size") == 2
    assert stack.value("engine.enforce_eager") is True
    assert stack.value("engine.prefix_caching") is False
    assert stack.value("engine.chunked_prefill") is False


def test_an_unknown_sglang_flag_is_listed_and_a_chunk_size_is_not_a_switch():
    stack = read("slime", SCRIPT, "--sglang-chunked-prefill-size", "4096", "--sglang-speculative-algorithm", "EAGLE")
    assert "engine.chunked_prefill" not in stack.values
    assert unmirrored(stack)["--sglang-chunked-prefill-size"] == 4096
    assert unmirrored(stack)["--sglang-speculative-algorithm"] == "EAGLE"


def test_a_script_without_train_py_is_refused(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo data.max_response_length=8\n")
    with pytest.raises(ConfigError, match=r"no `train.py` command"):
        read("slime", script)


def test_the_written_spec_loads_with_prompts_as_chat(tmp_path):
    data = tmp_path / "dapo.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + {i}?", "label": str(2 * i)}) + "\n" for i in range(8))
    )
    spec, text = written_spec("slime", tmp_path, SCRIPT, dataset=str(data), num_prompts=4)
    assert spec.engine.name == "sglang" and spec.engine.tensor_parallel_size == 2
    assert spec.sampling.n == 8 and spec.sampling.max_tokens == 8192
    assert spec.stack.framework == "slime" and [r.id for r in spec.stack.risks] == [SGLANG_FINDING]
    assert "--rollout-top-p: slime default (slime/utils/arguments.py:348-350 @ 624b824)" in text
    rows = [json.loads(line) for line in (tmp_path / "slime-prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["messages"][0]["role"] == "user" for r in rows)
