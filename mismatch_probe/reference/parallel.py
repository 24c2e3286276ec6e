"""Training layouts for the reference forward: Ulysses sequence parallelism and tensor parallelism.

The parallelism study behind this tool found that the *difference* in layout between sampler and
learner drives the worst-case mismatch, so the reference runs the layouts trainers use, for real,
one process per rank over a torch.distributed process group (gloo on CPU, NCCL on GPUs):

- **Ulysses sequence parallelism** (DeepSpeed-Ulysses, as verl's ``ulysses_sequence_parallel_size``):
  the packed row is cut into ``sp`` equal slices, one per rank, with global position ids. Every
  layer but attention is per-token, so it runs on the local slice. Around attention an all-to-all
  trades the sequence slice for a slice of the heads (each rank then sees the whole row for
  ``heads / sp`` heads), and a second all-to-all trades back. Key/value heads fewer than ``sp``
  are repeated first, as verl does. Each rank scores the tokens of its own slice; the scores are
  gathered in sequence order.
- **Tensor parallelism** with PyTorch's own API: ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on the projections the model's transformers tensor-parallel plan
  (``base_model_tp_plan``) names: q/k/v and gate/up column-wise, o and down row-wise, so each
  attention block and MLP ends in one all-reduce of partial sums. Fused MoE expert weights are
  not ``nn.Linear`` modules; they stay replicated, and ``info()`` says so.

The device mesh is ``(dp, sp, tp)``, tensor parallelism innermost (adjacent ranks), as trainers
lay it out on a node. Data parallelism (``dp`` > 1 only under torchrun, see
:mod:`mismatch_probe.reference.launch`) gives each group of ``sp * tp`` ranks its own sequences.
"""

from __future__ import annotations

import fnmatch
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mismatch_probe.errors import ConfigError

ULYSSES_ATTENTION = "mismatch_probe_ulysses"


@dataclass
class ParallelContext:
    """This process's place in the reference's process group."""

    rank: int
    sp: int
    tp: int
    device: str  # "cpu" or "cuda:<local rank>"
    mesh: object  # torch.distributed DeviceMesh with dims ("dp", "sp", "tp")
    dp: int = 1
    launcher: str = "torch.multiprocessing spawn, one process per rank"

    @property
    def world_size(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def leads_dp_group(self) -> bool:
        """The first rank of its data-parallel group: the one that writes the group's scores
        (every rank of the group holds the same ones)."""
        return self.mesh.get_local_rank("sp") == 0 and self.mesh.get_local_rank("tp") == 0

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank("sp")

    @property
    def sp_group(self):
        return self.mesh.get_group("sp")

    @property
    def backend(self) -> str:
        return dist.get_backend()


def init_rank(rank: int, sp: int, tp: int, init_method: str, device_type: str) -> ParallelContext:
    """Join the process group (one spawned rank of ``sp * tp``) and build the device mesh."""
    device = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank, world_size=sp * tp
    )
    return build_context(1, sp, tp, device_type, device)


def build_context(
    dp: int, sp: int, tp: int, device_type: str, device: str, launcher: str | None = None
) -> ParallelContext:
    """The ``(dp, sp, tp)`` device mesh over the initialized default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != dp * sp * tp:
        raise ConfigError(f"{dist.get_world_size()} ranks cannot be laid out as dp {dp} x sp {sp} x tp {tp}")
    mesh = init_device_mesh(device_type, (dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"))
    extra = {"launcher": launcher} if launcher else {}
    return ParallelContext(rank=dist.get_rank(), sp=sp, tp=tp, device=device, mesh=mesh, dp=dp, **extra)


def check_layout(config: dict, sp: int, tp: int) -> dict:
    """Check the model's heads split over the layout (before any process starts); returns the
    per-rank head counts. ``config`` is the checkpoint's config.json."""
    cfg = config.get("text_config") or config
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int):
        raise ConfigError("config.json has no num_attention_heads; cannot lay the model out over ranks")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if tp > 1 and (heads % tp or kv_heads % tp):
        raise ConfigError(
            f"--train-tp {tp}: the model has {heads} attention heads and {kv_heads} key/value heads, and tensor "
            f"parallelism gives each rank whole heads of both",
            hint=f"choose a tensor-parallel size that divides {heads} and {kv_heads}",
        )
    local_heads, local_kv = heads // tp, kv_heads // tp
    if sp > 1 and (local_heads % sp or (local_kv % sp and sp % local_kv)):
        raise ConfigError(
            f"--train-sp {sp}: each rank's {local_heads} attention and {local_kv} key/value heads (after tensor "
            f"parallelism) must split evenly over {sp} sequence-parallel ranks (or the key/value heads divide {sp}, "
            "and are then repeated)",
            hint=f"choose a sequence-parallel size that divides {local_heads}",
        )
    return {"attention_heads_per_rank": local_heads // sp, "kv_head_repeats": max(sp // local_kv, 1) if sp > 1 else 1}


# ---- tensor parallelism ----------------------------------------------------------------------


# the styles of transformers' tensor-parallel plans this reference runs, as PyTorch's own
# ParallelStyles: "colwise_gather_output" (fused qkv, or q/k/v followed by a norm over all heads:
# phi3, olmo2) gathers the projection's output so attention runs every head on every rank, and
# "rowwise_split_input" takes that replicated input and splits it before the row-wise matmul
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }[name]()


def check_tensor_parallel_plan(config) -> dict[str, str]:
    """The model's transformers tensor-parallel plan (``base_model_tp_plan``; ``config`` is its
    transformers config); refused when it does not shard the attention with a style this reference runs."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    attention = {style for pattern, style in plan.items() if ".self_attn." in pattern or ".attention." in pattern}
    if not attention & set(TP_STYLES):
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        found = (
            f"its plan shards attention with {sorted(attention)}" if attention else "it has no plan for its attention"
        )
        raise ConfigError(
            f"--train-tp: {arch} cannot be tensor-parallel here: {found} in transformers' base_model_tp_plan "
            f"(this reference runs {', '.join(TP_STYLES)})",
            hint="run this model with --train-tp 1",
        )
    return plan


def apply_tensor_parallel(decoder: torch.nn.Module, ctx: ParallelContext) -> dict:
    """Shard ``decoder``'s attention and MLP projections over the mesh's ``tp`` dimension with
    the model's own plan; returns what was sharded and what stayed replicated."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = check_tensor_parallel_plan(decoder.config)
    concrete: dict = {}
    sharded = dict.fromkeys(TP_STYLES, 0)
    replicated: set[str] = set()
    names = [name for name, _ in decoder.named_modules()]
    modules = dict(decoder.named_modules())
    for pattern, style in plan.items():
        for name in fnmatch.filter(names, pattern):
            # fused expert weights are parameters of one module, not Linear layers: replicated
            if style in TP_STYLES and isinstance(modules[name], torch.nn.Linear) and ".experts" not in f".{name}":
                concrete[name] = _style(style)
                sharded[style] += 1
            else:
                replicated.add(f"{pattern} ({style})")
    parallelize_module(decoder, ctx.mesh["tp"], concrete)
    return {
        "plan": "transformers base_model_tp_plan via torch parallelize_module",
        "sharded_linear_layers": {style: n for style, n in sharded.items() if n},
        "replicated": sorted(replicated),
        "lm_head_and_embeddings": "replicated",
    }


# ---- Ulysses sequence parallelism ------------------------------------------------------------


@dataclass
class _UlyssesBatch:
    group: object
    size: int
    position_ids: torch.Tensor  # [1, T] global, for attention kernels that read them
    kv_repeats: int


class UlyssesAttention:
    """An ``attn_implementation`` that wraps another one with the Ulysses all-to-alls.

    Outside :meth:`packed_row` (e.g. the load-time self-check) it is the inner attention alone.
    """

    def __init__(self, inner: str):
        self.inner = inner
        self.batch: _UlyssesBatch | None = None

    def register(self) -> str:
        from transformers import AttentionInterface

        AttentionInterface.register(ULYSSES_ATTENTION, self)
        return ULYSSES_ATTENTION

    @contextmanager
    def packed_row(self, group, size: int, position_ids: torch.Tensor, kv_repeats: int):
        self.batch = _UlyssesBatch(group, size, position_ids, kv_repeats)
        try:
            yield
        finally:
            self.batch = None

    def _inner_function(self, module):
        if self.inner == "eager":  # not in the registry: each model's module has its own
            import sys

            return sys.modules[type(module).__module__].eager_attention_forward
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.inner]

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        inner = self._inner_function(module)
        b = self.batch
        if b is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if query.shape[0] != 1:
            raise ValueError("Ulysses attention takes one packed row")
        if b.kv_repeats > 1:  # interleaved, so each rank's query heads keep their own key/value head
            key = key.repeat_interleave(b.kv_repeats, dim=1)
            value = value.repeat_interleave(b.kv_repeats, dim=1)
        query, key, value = (_sequence_to_heads(t, b.group, b.size) for t in (query, key, value))
        kwargs["position_ids"] = b.position_ids
        mask = None
        if self.inner == "eager":
            # eager attention reads its mask, not cu_seq_lens: the whole row's, from the global positions
            mask = packed_row_mask(b.position_ids[0], kwargs.get("sliding_window"), query.dtype)
            module = _LocalHeads(module, dist.get_rank(b.group), query.shape[1], query.shape[1] // key.shape[1])
        out, _ = inner(module, query, key, value, mask, **kwargs)
        return _heads_to_sequence(out, b.group, b.size), None


def packed_row_mask(position_ids: torch.Tensor, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive [1, 1, T, T] mask of a packed row for eager attention: each token sees the
    tokens before it in its own sequence (a new sequence starts where the position is 0), the
    last ``sliding_window`` of them on sliding-window layers (transformers' rule: i - j < window)."""
    seq = torch.cumsum(position_ids == 0, dim=0)
    i = torch.arange(len(position_ids), device=position_ids.device)
    allowed = (seq[:, None] == seq[None, :]) & (i[:, None] >= i[None, :])
    if sliding_window is not None:
        allowed &= i[:, None] - i[None, :] < sliding_window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class _LocalHeads:
    """An attention module as eager attention sees it on one Ulysses rank: this rank's share of
    the heads (a contiguous block, as :func:`_sequence_to_heads` hands them out), so per-head
    parameters (gpt-oss's sinks) are this block's, and key/value heads repeated per the local ratio."""

    def __init__(self, module: torch.nn.Module, rank: int, heads: int, groups: int):
        self._module = module
        self.num_key_value_groups = groups
        sinks = getattr(module, "sinks", None)
        if sinks is not None:
            self.sinks = sinks[rank * heads : (rank + 1) * heads]

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _sequence_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """[1, heads, T/n, d] (all heads, my slice of the row) -> [1, heads/n, T, d] (my heads, whole row)."""
    _, h, s, d = x.shape
    send = x.reshape(n, h // n, s, d).contiguous()  # chunk j: the heads rank j will own
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's slice of the row, my heads
    return recv.permute(1, 0, 2, 3).reshape(1, h // n, n * s, d)


def _heads_to_sequence(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """Attention output [1, T, heads/n, d] -> [1, T/n, heads, d] (my slice of the row, all heads)."""
    _, t, h, d = x.shape
    send = x.reshape(n, t // n, h, d).contiguous()  # chunk j: rank j's slice of the row
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: my slice, rank i's heads
    return recv.permute(1, 0, 2, 3).reshape(1, t // n, n * h, d)


def gather_rows(parts: list[torch.Tensor], counts: list[int], group) -> list[torch.Tensor]:
    """Concatenate, in rank order, each rank's first ``counts[rank]`` rows of every tensor in ``parts``.

    Collectives need equal sizes, so each part is padded to the largest count first.
    """
    width = max(counts)
    if width == 0:
        return parts
    out = []
    for part in parts:
        padded = part.new_zeros((width, *part.shape[1:]))
        padded[: len(part)] = part
        chunks = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(chunks, padded, group=group)
        out.append(torch.cat([c[:k] for c, k in zip(chunks, counts)]))
    return out


# ---- FSDP2 -----------------------------------------------------------------------------------


class FsdpRoot(torch.nn.Module):
    """The root FSDP unit around the whole model: it holds what the decoder layers' own units do
    not (embeddings, final norm, LM head, tied or not), gathered for the whole of one micro-batch,
    whose scoring runs as this module's forward (``root(fn)`` calls ``fn()``). The reference
    calls the decoder and the LM head separately (the head in chunks), so it cannot use the
    model's own ``forward`` as the root's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn):
        return fn()


def _dtype(name: str | None):
    return None if name is None else getattr(torch, name)


# glibc's allocator keeps the per-layer gather buffers FSDP2 frees on a CPU rank in its heap, so
# the rank's resident memory grows by most of a layer per layer of a forward (measured: 2.6 ->
# 6.6 GiB over 48 layers); with the threshold fixed from the start (this environment variable,
# read when the process starts) every buffer of 1 MiB or more is mapped on its own and given
# back when freed (2.6 -> 3.0 GiB). mallopt() later in the process does not undo the growth.
CPU_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "1048576")


def apply_fsdp(model: torch.nn.Module, ctx: ParallelContext, spec) -> tuple[FsdpRoot, dict]:
    """``fully_shard`` each decoder layer and a root around the model (as verl's ``apply_fsdp2``
    groups them, the embeddings and LM head kept in the root) over the data- and
    sequence-parallel ranks (tensor parallelism, if any, stays inside each shard: 2-D)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if ctx.sp == 1:
        mesh, over = ctx.mesh["dp"], "dp"
    elif ctx.dp == 1:
        mesh, over = ctx.mesh["sp"], "sp"
    else:
        mesh, over = ctx.mesh["dp", "sp"]._flatten("dp_sp"), "dp x sp"
    policy = MixedPrecisionPolicy(
        param_dtype=_dtype(spec.fsdp_param_dtype),
        reduce_dtype=_dtype(spec.fsdp_reduce_dtype),
        output_dtype=_dtype(spec.fsdp_output_dtype),
        cast_forward_inputs=True,
    )
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard with FSDP",
            hint="score it without reference.fsdp",
        )
    layer_class = type(layers[0]).__name__  # before fully_shard renames it FSDP<class>
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    allocator = None
    if ctx.device == "cpu":
        name, value = CPU_MALLOC_ENV
        allocator = f"{name}={os.environ[name]}" if name in os.environ else f"{name} unset (set {name}={value})"
    root = FsdpRoot(model)
    # the root's outputs are the scores: never cast them to output_dtype
    root_policy = MixedPrecisionPolicy(
        param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype, cast_forward_inputs=True
    )
    fully_shard(root, mesh=mesh, mp_policy=root_policy, reshard_after_forward=True)
    return root, {
        "api": "torch.distributed.fsdp.fully_shard (FSDP2)",
        "mesh": over,
        "shards": mesh.size(),
        "mixed_precision": {
            "param_dtype": spec.fsdp_param_dtype,
            "reduce_dtype": spec.fsdp_reduce_dtype,
            "output_dtype": spec.fsdp_output_dtype,
            "cast_forward_inputs": True,
        },
        "master_weights_dtype": spec.dtype,
        "units": f"{len(layers)} x {layer_class}, then a root with the rest (embeddings, norm, LM head)",
        "reshard_after_forward": True,
        **({"cpu_allocator": allocator} if allocator else {}),
    }
