"""describe_architecture: each family quirk read from a config and weight names, by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.architecture import describe_architecture
from mismatch_probe.reference.parallel import check_tensor_parallel_plan


def cfg(**kw):
    base = {"model_type": "x", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4}
    return SimpleNamespace(**{**base, **kw})


def test_plain_decoder_has_no_quirks():
    d = describe_architecture(cfg(num_key_value_heads=2, tie_word_embeddings=False), ["lm_head.weight"])
    assert d["quirks"] == [] and d["kv_heads"] == 2 and d["tied_embeddings"] is False


def test_logit_quirks_and_soft_caps():
    d = describe_architecture(cfg(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True))
    assert d["final_logit_softcapping"] == 30.0 and d["attn_logit_softcapping"] == 50.0 and d["tied_embeddings"]
    assert any("soft-capped at 30" in q for q in d["quirks"]) and any("eager" in q for q in d["quirks"])
    assert describe_architecture(cfg(logit_scale=0.0625))["logit_scale"] == 0.0625
    assert "logits_scaling" not in describe_architecture(cfg(logits_scaling=1.0))  # granite's neutral value
    assert describe_architecture(cfg(logits_scaling=16.0))["logits_scaling"] == 16.0


def test_sliding_windows_by_layer_type_and_qwen2_max_window_layers():
    d = describe_architecture(cfg(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2))
    assert d["sliding_window"] == {"size": 16, "layers": [0, 2], "of_layers": 4}
    assert "2 of 4 layers (0, 2)" in " ".join(d["quirks"])
    assert describe_architecture(cfg(sliding_window=16))["sliding_window"]["layers"] == [0, 1, 2, 3]
    # qwen2: the window is configured but off unless use_sliding_window
    assert "sliding_window" not in describe_architecture(cfg(sliding_window=4096, use_sliding_window=False))
    qwen2 = cfg(sliding_window=8, use_sliding_window=True, max_window_layers=3)
    assert describe_architecture(qwen2)["sliding_window"]["layers"] == [3]


def test_sinks_and_tied_embeddings_from_weight_names():
    d = describe_architecture(cfg(), ["model.layers.0.self_attn.sinks", "model.embed_tokens.weight"])
    assert d["attention_sinks"] is True and d["tied_embeddings"] is True  # no lm_head tensor
    assert describe_architecture(cfg(), ["model.embed_tokens.weight", "lm_head.weight"])["tied_embeddings"] is False


def test_moe_with_shared_experts_grouped_routing_and_dense_layers():
    d = describe_architecture(
        cfg(
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_shared_experts=1,
            first_k_dense_replace=3,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            kv_lora_rank=512,
            q_lora_rank=1536,
        )
    )
    assert d["moe"] == {
        "routed_experts": 256,
        "top_k": 8,
        "shared_experts": 1,
        "first_dense_layers": 3,
        "grouped_routing": {"groups": 8, "top_groups": 4},
        "routed_scaling_factor": 2.5,
    }
    assert d["latent_attention"] == {"kv_lora_rank": 512, "q_lora_rank": 1536}
    assert (
        describe_architecture(cfg(num_experts=60, num_experts_per_tok=4, shared_expert_intermediate_size=5632))["moe"][
            "shared_experts"
        ]
        == 1
    )  # qwen2_moe's one shared expert


def test_tensor_parallel_plan_refusals_name_the_styles():
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    assert check_tensor_parallel_plan(SimpleNamespace(base_model_tp_plan=plan)) == plan
    fused = SimpleNamespace(
        architectures=["Xyz"], base_model_tp_plan={"layers.*.self_attn.qkv": "local_packed_rowwise"}
    )
    with pytest.raises(ConfigError, match=r"Xyz .*\['local_packed_rowwise'\]"):
        check_tensor_parallel_plan(fused)
    with pytest.raises(ConfigError, match="no plan for its attention"):
        check_tensor_parallel_plan(SimpleNamespace(architectures=["Abc"], base_model_tp_plan=None))
