"""Routing replay (R3) on real tiny MoE models: forwards with the routing of chosen rows forced to
given experts (``modeling/routing.py: ForcedRouting``) against the model's own free forward and a
float64 MoE layer computed by hand, and the router of every tiny MoE family (tests/tiny_models.py)
against its own weighting rule by hand. Routers compute their scores in float32 whatever the
model's dtype, so "by hand in float64" agrees to float32 rounding of the weights (~1e-7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from conftest import MOE
from tiny_models import COMMON, FAMILIES, MOE_FAMILIES

from mismatch_probe.modeling.routing import ForcedRouting, RouterRecorder, check_forced_routing, replay_refusal


def _load(dtype=torch.float32, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(MOE), dtype=dtype, **kw).eval()


def _other_experts(rng, n_rows: int, n_layers: int, k: int, n_experts: int) -> torch.Tensor:
    """Distinct sorted expert ids per row and layer: [rows, layers, k]."""
    ids = [np.sort(rng.choice(n_experts, k, replace=False)) for _ in range(n_rows * n_layers)]
    return torch.from_numpy(np.array(ids, dtype=np.int64).reshape(n_rows, n_layers, k))


def test_forcing_the_models_own_routing_is_the_free_forward_bit_for_bit():
    model, ids = _load(), torch.arange(3, 43)[None]
    recorder, replay = RouterRecorder(model), ForcedRouting(model)
    rows = torch.arange(4, 40)  # the first rows route freely
    with torch.inference_mode():
        with recorder:
            free = model(input_ids=ids).logits
            own = recorder.take()
        with replay.force(rows, own[rows]):
            forced = model(input_ids=ids).logits
    assert torch.equal(free, forced)


def test_forced_rows_route_to_the_forced_experts_and_the_others_route_freely():
    model, ids = _load(), torch.arange(3, 43)[None]
    recorder, replay = RouterRecorder(model), ForcedRouting(model)
    rows = torch.tensor([5, 9, 10, 30])
    other = _other_experts(np.random.default_rng(0), len(rows), 4, 2, 8)
    with torch.inference_mode(), recorder:
        free = model(input_ids=ids).logits
        own = recorder.take()
        with replay.force(rows, other):
            forced = model(input_ids=ids).logits
        took = recorder.take()
    assert torch.equal(took[rows].long(), other)
    assert torch.equal(took[:5], own[:5])  # before the first forced row nothing differs
    # causal: positions before the first forced row see the same inputs (float32 rounding of the
    # experts' matmuls over other row sets aside); from it on the output moves
    assert (forced[0, :5] - free[0, :5]).abs().max() < 1e-4
    assert (forced[0, 5] - free[0, 5]).abs().max() > 1e-2


def _moe_block_by_hand(block, h: np.ndarray, forced: dict[int, np.ndarray]) -> np.ndarray:
    """Qwen3-MoE's sparse block in float64 NumPy: softmax router, top-k (or the forced ids),
    weights renormalized over the chosen experts, SwiGLU experts."""
    gate = block.gate.weight.detach().double().numpy()
    gate_up = block.experts.gate_up_proj.detach().double().numpy()
    down = block.experts.down_proj.detach().double().numpy()
    k, inter = block.gate.top_k, block.experts.intermediate_dim
    out = np.zeros_like(h)
    for t, x in enumerate(h):
        logits = gate @ x
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = forced[t] if t in forced else np.argsort(-p, kind="stable")[:k]
        w = p[chosen] / p[chosen].sum()
        for e, we in zip(chosen, w):
            g, u = gate_up[e][:inter] @ x, gate_up[e][inter:] @ x
            out[t] += we * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_a_forced_moe_layer_is_the_float64_layer_by_hand():
    model = _load(torch.float64, experts_implementation="eager")  # grouped_mm has no float64
    block = model.model.layers[1].mlp
    rng = np.random.default_rng(1)
    h = rng.normal(size=(12, model.config.hidden_size))
    rows = np.array([0, 3, 4, 11])
    other = _other_experts(rng, len(rows), 1, 2, 8)
    replay = ForcedRouting(torch.nn.ModuleDict({"layers": torch.nn.ModuleList([model.model.layers[1]])}))
    with torch.inference_mode(), replay.force(torch.from_numpy(rows), other):
        got = block(torch.from_numpy(h)[None])[0].numpy()
    want = _moe_block_by_hand(block, h, {int(t): ids[0].numpy() for t, ids in zip(rows, other)})
    # the router computes its probabilities in float32 (softmax(dtype=torch.float)) whatever the
    # model's dtype: float32 rounding of the weights, nothing more
    assert np.abs(got - want).max() < 1e-6 * np.abs(want).max()
    assert np.abs(want).max() > 0.1  # a layer that does something
    # the same layer with the experts it chose itself: forced rows moved, the others did not
    with torch.inference_mode():
        free = block(torch.from_numpy(h)[None])[0].numpy()
    assert np.abs(free - _moe_block_by_hand(block, h, {})).max() < 1e-6 * np.abs(want).max()
    assert np.abs(got - free)[rows].max() > 1e-2
    assert np.abs(np.delete(got, rows, 0) - np.delete(free, rows, 0)).max() < 1e-12  # other row sets per expert


# the weighting rule of each family's router, by hand in float64: weights of the chosen ids
def _softmax_renormalized(r, h, ids):
    p = torch.softmax(h @ r.weight.double().T, -1)
    w = p.gather(-1, ids)
    return w / w.sum(-1, keepdim=True)


def _softmax_after_topk(r, h, ids):  # GPT-OSS: biased logits, softmax over the chosen ones
    return torch.softmax((h @ r.weight.double().T + r.bias.double()).gather(-1, ids), -1)


def _sigmoid_renormalized_scaled(r, h, ids):  # DeepSeek-V3, GLM-4-MoE: the bias chooses, never weighs
    s = torch.sigmoid(h @ r.weight.double().T).gather(-1, ids)
    return s / (s.sum(-1, keepdim=True) + 1e-20) * r.routed_scaling_factor


WEIGHTS = {
    "qwen3_moe": _softmax_renormalized,
    "mixtral": _softmax_renormalized,
    "gpt_oss": _softmax_after_topk,
    "deepseek_v3": _sigmoid_renormalized_scaled,
    "glm4_moe": _sigmoid_renormalized_scaled,
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_familys_router_weighs_forced_experts_by_its_own_rule(family):
    fam = FAMILIES[family]
    config = getattr(transformers, fam.config_class)(**{**COMMON, **fam.kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, fam.model_class)(config).double().eval()
    layer, router = ForcedRouting(model).routers[0]
    assert replay_refusal(router) is None
    with torch.no_grad():  # a bias that changes which experts are chosen, not their weights
        for name in ("e_score_correction_bias", "bias"):
            if isinstance(getattr(router, name, None), torch.Tensor):
                getattr(router, name).copy_(torch.randn_like(getattr(router, name)))
    rng = np.random.default_rng(2)
    h = torch.from_numpy(rng.normal(size=(10, config.hidden_size)))
    rows = torch.tensor([1, 2, 7])
    k = router.top_k
    forced = _other_experts(rng, len(rows), 1, k, router.num_experts)
    forced[0, 0] = torch.tensor([0, router.num_experts - 1])  # both ends: DeepSeek's groups differ
    only = ForcedRouting(torch.nn.ModuleDict({f"layers_{layer}": router}))
    with torch.inference_mode():
        _, free_w, free_ids = router(h)
        with only.force(rows, forced):
            _, w, ids = router(h)
    assert torch.equal(ids[rows].sort(-1).values, forced[:, 0])
    want = WEIGHTS[family](router, h[rows], ids[rows])
    # routers compute their scores in float32 whatever the model's dtype: float32 rounding, no more
    assert (w[rows].double() - want).abs().max() < 1e-6
    keep = torch.ones(len(h), dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(ids[keep], free_ids[keep]) and torch.equal(w[keep], free_w[keep])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_tiny_moe_family_passes_the_replay_self_check(zoo, family):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(zoo[family]), dtype=torch.float32).eval()
    with torch.inference_mode():
        assert check_forced_routing(model, torch.arange(3, 19)[None]) is None


def test_routers_that_do_not_fit_are_refused_by_name():
    v2 = transformers.DeepseekV2Config(
        **COMMON,
        num_hidden_layers=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
    )
    router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(v2)
    assert "group_limited_greedy" in replay_refusal(router)
    replay = ForcedRouting(torch.nn.ModuleDict({"layers_0": router}))
    with pytest.raises(ValueError, match="group_limited_greedy"), replay.force(torch.tensor([0]), torch.zeros(1, 1, 2)):
        pass
    # Phi-MoE chooses with sparsemixer, no top-k: caught when it runs
    phi = transformers.PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    router = transformers.models.phimoe.modeling_phimoe.PhimoeTopKRouter(phi).eval()
    replay = ForcedRouting(torch.nn.ModuleDict({"layers_0": router}))
    forced = replay.force(torch.tensor([0]), torch.tensor([[[0, 1]]]))
    with torch.inference_mode(), pytest.raises(ValueError, match="made 0 top-2 selections"), forced:
        router(torch.randn(3, 128))


def test_forced_ids_are_checked():
    model = _load()
    replay = ForcedRouting(model)
    for rows, bad, message in (
        ([1], [[[0, 8]] * 4], r"outside \[0, 8\)"),
        ([1], [[[3, 3]] * 4], "one expert twice"),
        ([1], [[[0, 1]] * 3], r"\(1, 3, 2\); expected \[1 rows, 4 MoE layers"),
        ([100], [[[0, 1]] * 4], "row 100 forced, but the router scores 6 rows"),  # raised inside a router
    ):
        forced = replay.force(torch.tensor(rows), torch.tensor(bad))
        with pytest.raises(ValueError, match=message), torch.inference_mode(), forced:
            model(input_ids=torch.arange(3, 9)[None])
    # a forward that failed inside a router left no mode behind: top-k is itself again
    assert torch.topk(torch.tensor([[1.0, 3.0, 2.0]] * 6), 2).indices.tolist() == [[1, 2]] * 6
