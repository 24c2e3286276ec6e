"""fixtures/shapes.py: realistic-shape checkpoints built without a download, with peaked next-token
distributions. Here at its smoke widths (the real vocabulary of 151,936 kept): the config keys of
the published checkpoints, an entropy far below log V, no mass on the ids the fixture's tokenizer
lacks, and a checkpoint transformers loads. Loading them in vLLM is benchmarks/bench_run_cost.py's
(its full size; its smoke run takes the fixture)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "fixtures"))
import shapes

QWEN3_MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "head_dim",
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {
        like: (
            root / like,
            shapes.build_peaked(
                root / like, like, shape=shapes.SMOKE_SHAPES[like], calibration=6, generate_tokens=12, seed=0
            ),
        )
        for like in shapes.PEAKED
    }


def test_the_configs_carry_the_published_keys_and_the_real_vocabulary(built):
    dense = json.loads((built["qwen2.5-0.5b"][0] / "config.json").read_text())
    moe = json.loads((built["qwen3-moe-small"][0] / "config.json").read_text())
    assert dense["architectures"] == ["Qwen2ForCausalLM"] and dense["tie_word_embeddings"] is True
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"] and moe["tie_word_embeddings"] is False
    assert all(k in moe for k in QWEN3_MOE_KEYS), [k for k in QWEN3_MOE_KEYS if k not in moe]
    assert moe["num_experts_per_tok"] == 8 and moe["num_experts"] == 16 and moe["norm_topk_prob"] is True
    assert dense["vocab_size"] == moe["vocab_size"] == 151936
    assert dense["dtype"] == moe["dtype"] == "bfloat16"


@pytest.mark.parametrize("like", shapes.PEAKED)
def test_the_next_token_distribution_is_peaked_and_stays_in_the_tokenizer(built, like):
    info = built[like][1]
    log_v = math.log(151936)
    assert info["log_vocab"] == pytest.approx(log_v, abs=1e-3)
    for where in ("corpus", "prompts"):
        entropy = info[where]["mean_entropy_nats"]
        assert 1.0 < entropy < log_v - 6, f"{where}: mean entropy {entropy} nats (log V {log_v:.2f})"
        assert info[where]["max_mass_outside_tokenizer"] < 1e-9
    assert info["corpus"]["mean_entropy_nats"] == pytest.approx(2.5, abs=0.75)  # calibrated on other conversations
    for mode in ("greedy", "sampled"):
        assert info["generation"][mode]["ids_outside_tokenizer"] == 0
    assert info["generation"]["sampled"]["distinct_share"] > 0.2  # not one token over and over
    assert json.loads((built[like][0] / "shape.json").read_text()) == info


@pytest.mark.parametrize("like", shapes.PEAKED)
def test_transformers_loads_the_checkpoint_and_its_best_tokens_decode(built, like):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = built[like][0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if like == "qwen3-moe-small":
        assert model.config.num_experts == 16  # config.json's num_experts, read by transformers' own name
    ids = shapes.prompt_ids(tokenizer, 2)[1]
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    best = logits.argmax(-1)
    assert int(best.max()) < len(tokenizer)
    assert isinstance(tokenizer.decode(best.tolist()), str)


def test_the_random_checkpoint_benchmark_takes_its_shapes_from_here():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import random_checkpoint

    assert random_checkpoint.SHAPES is shapes.SHAPES and random_checkpoint.build is shapes.build
