"""Sharded loading (mismatch_probe.modeling.sharded_loading): a model built on the meta device and
filled slice by slice from its safetensors files holds exactly what ``from_pretrained`` loads.

Tiny random Qwen2 checkpoints are written at test time with ``save_pretrained``: untied and tied,
one file and several (an index). The vocabulary is odd, so under FSDP2 over 2 ranks the embedding
and LM head shard unevenly on dim 0. The layouts run for real over gloo, as rank processes
(torch.multiprocessing spawn, a file:// store); each rank checks its own model against a
``from_pretrained`` one and reports what it read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mismatch_probe.modeling.sharded_loading import (
    METHOD,
    NeedsFullLoad,
    build_on_meta,
    check_loadable,
    load_local_shards,
)

ROOT = Path(__file__).resolve().parent.parent.parent
MOE = ROOT / "fixtures" / "models" / "tiny-qwen3-moe"
VOCAB = 1001  # odd: dim 0 of the embedding and LM head does not divide by 2
CHECKPOINTS = {  # name: (tie_word_embeddings, max_shard_size or None for one file)
    "untied": (False, None),
    "tied": (True, None),
    "untied-indexed": (False, "100KB"),
    "tied-indexed": (True, "100KB"),
}


def _save_tiny_qwen2(out: Path, *, tied: bool, max_shard_size: str | None, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,  # logits well away from uniform
        tie_word_embeddings=tied,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded wrongly (or not at all) shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.config.dtype = "float32"
    out.mkdir(parents=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded-loading")
    out = {
        name: _save_tiny_qwen2(root / name, tied=tied, max_shard_size=size)
        for name, (tied, size) in CHECKPOINTS.items()
    }
    for name, path in out.items():  # the checkpoints are what their names say
        indexed = (path / "model.safetensors.index.json").is_file()
        assert indexed == name.endswith("indexed")
        if indexed:
            files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
            assert len(files) > 1
    return out


def _from_pretrained(path: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation).eval()


def _ids(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def _all_on_meta(model) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


# ---- one process: the plain (unsharded) case -------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_process_loads_what_from_pretrained_loads(checkpoints, name, dtype):
    path = checkpoints[name]
    model = build_on_meta(path, dtype=dtype, attn_implementation="sdpa", trust_remote_code=False)
    assert _all_on_meta(model) and not model.training
    assert all(b.device.type == "cpu" for b in model.buffers())  # rotary inv_freq: computed, not meta
    tied = CHECKPOINTS[name][0]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    check_loadable(model, path)

    record = load_local_shards(model, path, "cpu")

    ref = _from_pretrained(path, getattr(torch, dtype))
    assert record["method"] == METHOD
    assert record["bytes_read"] == record["bytes_total"] > 0  # one process reads everything, once
    assert record["tensors"] == len(list(ref.parameters()))  # a tied weight is one tensor
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied  # still tied after loading
    for pname, param in model.named_parameters(remove_duplicate=False):
        want = ref.get_parameter(pname)
        assert param.dtype == want.dtype and torch.equal(param, want), pname
    for bname, buf in model.named_buffers():
        assert torch.equal(buf, ref.get_buffer(bname)), bname
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, ref(_ids()).logits)


def test_tied_checkpoint_holding_only_the_lm_head(checkpoints, tmp_path):
    """from_pretrained ties the other way round when only the tied *target* is stored."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "lm-head-only"
    shutil.copytree(checkpoints["tied"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = build_on_meta(path, dtype="float32", attn_implementation="sdpa", trust_remote_code=False)
    load_local_shards(model, path, "cpu")
    ref = _from_pretrained(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert torch.equal(model.model.embed_tokens.weight, tensors["lm_head.weight"])


def test_keep_in_fp32_modules_load_as_from_pretrained(tmp_path):
    """RWKV keeps time_decay / time_first in float32 when loaded in float16 (_keep_in_fp32_modules)."""
    from transformers import RwkvConfig, RwkvForCausalLM

    path = tmp_path / "rwkv"
    config = RwkvConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64
    )
    torch.manual_seed(0)
    RwkvForCausalLM(config).float().save_pretrained(path)
    model = build_on_meta(path, dtype="float16", attn_implementation="eager", trust_remote_code=False)
    load_local_shards(model, path, "cpu")
    ref = _from_pretrained(path, torch.float16, attn_implementation="eager")
    assert model.rwkv.blocks[0].attention.time_decay.dtype == torch.float32
    for pname, param in model.named_parameters():
        want = ref.get_parameter(pname)
        assert param.dtype == want.dtype and torch.equal(param, want), pname


# ---- NeedsFullLoad: raised before anything is materialized ------------------------------------


def _renamed_copy(src: Path, dst: Path, old: str, new: str) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[new] = tensors.pop(old)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_renamed_tensor_needs_full_load(checkpoints, tmp_path):
    key = "model.layers.1.mlp.down_proj.weight"
    path = _renamed_copy(checkpoints["untied"], tmp_path / "renamed", key, "model.layers.1.mlp.down.weight")
    model = build_on_meta(path, dtype="float32", attn_implementation="sdpa", trust_remote_code=False)
    with pytest.raises(NeedsFullLoad, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        check_loadable(model, path)
    with pytest.raises(NeedsFullLoad, match="not in the checkpoint"):
        load_local_shards(model, path, "cpu")
    assert _all_on_meta(model)  # nothing was materialized, so nothing was loaded wrongly


def test_shape_mismatch_needs_full_load(checkpoints, tmp_path):
    path = tmp_path / "wider"
    shutil.copytree(checkpoints["untied"], path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 160
    (path / "config.json").write_text(json.dumps(config))
    model = build_on_meta(path, dtype="float32", attn_implementation="sdpa", trust_remote_code=False)
    with pytest.raises(NeedsFullLoad, match=r"mlp\.\w+_proj\.weight.*shape"):
        load_local_shards(model, path, "cpu")
    assert _all_on_meta(model)


def test_tied_weights_stored_twice_need_full_load(checkpoints, tmp_path):
    """from_pretrained compares the two and unties them if they differ: not a one-to-one mapping."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "both"
    shutil.copytree(checkpoints["tied"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 2
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = build_on_meta(path, dtype="float32", attn_implementation="sdpa", trust_remote_code=False)
    with pytest.raises(NeedsFullLoad, match="tied"):
        check_loadable(model, path)


def test_checkpoint_transformers_converts_needs_full_load():
    """The MoE fixture stores one tensor per expert; transformers fuses them into one parameter."""
    model = build_on_meta(MOE, dtype="float32", attn_implementation="sdpa", trust_remote_code=False)
    with pytest.raises(NeedsFullLoad, match=r"converts checkpoint tensor 'model\.layers\.\d+\.mlp\.experts"):
        load_local_shards(model, MOE, "cpu")
    assert _all_on_meta(model)


# ---- real layouts over gloo ------------------------------------------------------------------


def _tensor_parallel(model, ctx) -> None:
    """The reference's own tensor-parallel plan, on the meta-device model."""
    from mismatch_probe.reference.parallel import apply_tensor_parallel

    layers = model.config.num_hidden_layers
    info = apply_tensor_parallel(model.base_model, ctx)
    assert info["sharded_linear_layers"] == {"colwise": 5 * layers, "rowwise": 2 * layers}


def _fully_shard(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _rank_main(rank: int, world: int, store: str, layouts: list[str], checkpoints: dict, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mismatch_probe.reference.parallel import build_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        records: dict = {}
        for layout in layouts:
            dp, tp = {"tp": (1, world), "fsdp": (world, 1), "fsdp+tp": (2, world // 2)}[layout]
            ctx = build_context(dp, 1, tp, "cpu", "cpu")  # the reference's own (dp, sp, tp) mesh
            for name, path in checkpoints.items():
                path = Path(path)
                model = build_on_meta(path, dtype="float32", attn_implementation="sdpa", trust_remote_code=False)
                if "tp" in layout:
                    _tensor_parallel(model, ctx)
                if "fsdp" in layout:
                    _fully_shard(model, ctx.mesh["dp"])
                check_loadable(model, path)
                record = load_local_shards(model, path, "cpu")
                ref = _from_pretrained(path)
                placements = set()
                for pname, param in model.named_parameters(remove_duplicate=False):
                    full = param
                    if isinstance(param, DTensor):
                        placements.add(repr(tuple(param.placements)))
                        full = param.full_tensor()
                    assert torch.equal(full, ref.get_parameter(pname)), f"{layout} {name}: {pname}"
                for bname, buf in model.named_buffers():
                    assert torch.equal(buf, ref.get_buffer(bname)), f"{layout} {name}: {bname}"
                with torch.no_grad():
                    got, want = model(_ids()).logits, ref(_ids()).logits
                got = got.full_tensor() if isinstance(got, DTensor) else got
                diff = float((got - want).abs().max())
                assert diff < 1e-5 * float(want.abs().max()), f"{layout} {name}: logits differ by {diff}"
                records[f"{layout} {name}"] = {**record, "max_logit_diff": diff, "placements": sorted(placements)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _run_ranks(world: int, layouts: list[str], checkpoints: dict[str, Path], out: Path) -> list[dict]:
    """Start ``world`` rank processes that load every checkpoint in every layout, check each model
    against from_pretrained (an assertion in a rank fails the test with its traceback) and report
    what they read."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    args = (world, str(out / "store"), layouts, {k: str(v) for k, v in checkpoints.items()}, str(out))
    mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> list[dict]:
    """TP=2 and FSDP2 over 2 ranks, every checkpoint, in one pair of rank processes."""
    return _run_ranks(2, ["tp", "fsdp"], checkpoints, tmp_path_factory.mktemp("two-ranks"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tensor_parallel_ranks_load_their_slices(two_ranks, name):
    r0, r1 = (rank[f"tp {name}"] for rank in two_ranks)
    assert r0["bytes_total"] == r1["bytes_total"] and r0["bytes_read"] == r1["bytes_read"]
    # each rank reads half of every projection and all of the (replicated) rest
    assert r0["bytes_total"] / 2 < r0["bytes_read"] < r0["bytes_total"]
    assert {"(Shard(dim=0),)", "(Shard(dim=1),)"} <= set(r0["placements"])
    assert r0["max_logit_diff"] < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fsdp2_ranks_load_their_slices(two_ranks, name):
    r0, r1 = (rank[f"fsdp {name}"] for rank in two_ranks)
    assert r0["bytes_read"] + r1["bytes_read"] == r0["bytes_total"]  # every byte read once, by one rank
    assert r1["bytes_read"] < r0["bytes_read"]  # the odd vocabulary: rank 1's shards are shorter
    assert r0["placements"] == ["(Shard(dim=0),)"]


@pytest.mark.distributed
def test_fsdp2_over_tensor_parallel(checkpoints, tmp_path):
    """4 ranks, dp 2 x tp 2: FSDP2 shards the tensor-parallel shards again (dim 0 of a column-wise
    projection becomes a _StridedShard)."""
    subset = {k: v for k, v in checkpoints.items() if k in ("untied", "tied-indexed")}
    ranks = _run_ranks(4, ["fsdp+tp"], subset, tmp_path)
    for name in subset:
        record = ranks[0][f"fsdp+tp {name}"]
        assert any("_StridedShard" in p for p in record["placements"])
        # projections: a quarter each; embeddings, norms, LM head: half (sharded over dp, replicated over tp)
        total = record["bytes_total"]
        assert all(total / 4 < rank[f"fsdp+tp {name}"]["bytes_read"] < total / 2 for rank in ranks)
