"""MoE routing capture: which experts each token was sent to, per MoE layer, on either side.

transformers' MoE models route through ``*TopKRouter`` modules that return
``(router_logits, router_scores, router_indices)``. Forward hooks on those modules record the
top-k expert ids; ids are sorted per token so that "same expert set" is plain row equality.

For a model token at position t, the routing that shaped its probability is the routing of the
input at t-1 (the hidden state that produced the logits). Both sides record exactly that: the
engine keeps the last input position of each forward (prefill, then each decode step); the
reference keeps the rows it scores.

:class:`ForcedRouting` runs forwards with the routing of chosen rows forced to given experts:
rollout routing replay (R3, as Megatron, verl and slime replay the engine's experts in the
trainer). The router still computes its scores as usual; only its top-k selection is replaced, so
the weights are its own scores at the replayed ids, normalized its own way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self

import torch
from torch.overrides import TorchFunctionMode

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.lower().endswith("topkrouter")


def find_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """The model's ``*TopKRouter`` modules with their decoder layer index, in module order."""
    routers: list[tuple[int, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if _is_router(module):
            match = _LAYER.search(f".{name}.")
            routers.append((int(match.group(1)) if match else len(routers), module))
    return routers


def _indices(output) -> torch.Tensor | None:
    """The router's expert ids: the last integer tensor of its output tuple."""
    if isinstance(output, torch.Tensor):
        return output if not output.is_floating_point() else None
    for item in reversed(tuple(output)):
        if isinstance(item, torch.Tensor) and not item.is_floating_point() and item.dim() == 2:
            return item
    return None


class RouterRecorder:
    """Context manager recording each router's top-k expert ids during forwards.

    ``take()`` returns the ids of the forwards since the last ``take()`` as an int16 tensor
    ``[tokens, n_layers, k]`` (tokens flattened row-major over the batch) and clears them.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.layers = [layer for layer, _ in self.routers]
        self._captured: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list = []

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def __enter__(self) -> Self:
        for slot, (_, module) in enumerate(self.routers):
            self._handles.append(module.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured = [[] for _ in self.routers]

    def _hook(self, slot: int):
        def hook(module, args, output):
            ids = _indices(output)
            if ids is None:
                raise RuntimeError(f"{type(module).__name__} returned no expert ids; cannot record routing")
            self._captured[slot].append(ids.sort(dim=-1).values.to(torch.int16))

        return hook

    def take(self) -> torch.Tensor:
        per_layer = [torch.cat(parts) for parts in self._captured]
        self._captured = [[] for _ in self.routers]
        return torch.stack(per_layer, dim=1)

    def describe(self, model: torch.nn.Module) -> dict:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return {
            "moe_layers": self.layers,
            "top_k": getattr(cfg, "num_experts_per_tok", None),
            "num_experts": getattr(cfg, "num_experts", None)
            or getattr(cfg, "num_local_experts", None)
            or getattr(cfg, "n_routed_experts", None),
        }


# ---- routing replay (R3) -----------------------------------------------------------------------

_TOPK_ARGS = ("input", "k", "dim", "largest", "sorted")


def _routed_experts(module: torch.nn.Module) -> int | None:
    """How many experts a router's top-k picks among (Longcat's zero experts included)."""
    for name in ("n_routed_experts", "num_experts"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def replay_refusal(module: torch.nn.Module) -> str | None:
    """Why the routing of this router cannot be replayed by replacing its top-k (None: it can).

    Every transformers 5 ``*TopKRouter`` picks its experts with one ``torch.topk`` of ``top_k``
    over a [tokens, experts] score tensor, and takes the weights either from that top-k's values
    (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS: softmax after the top-k; Granite) or by gathering its
    own scores at the chosen ids (DeepSeek-V3, GLM-4-MoE: grouped top-k with a bias; Longcat,
    MiniMax-M2). A replayed top-k returns the forced ids with the top-k input's own values at
    them, so both get the router's own weights. DeepSeek-V2's ``group_limited_greedy`` is the
    exception: its weights are the top-k values of scores already zeroed outside the groups it
    chose, so a replayed expert outside them would weigh 0. Routers without a top-k at all
    (Phi-MoE's sparsemixer) are caught when they run (:class:`ForcedRouting`)."""
    name = type(module).__name__
    if getattr(module, "topk_method", None) == "group_limited_greedy":
        return (
            f"{name} (topk_method 'group_limited_greedy') weighs experts by the top-k of scores already "
            "zeroed outside the expert groups it chose: a replayed expert outside them would weigh 0"
        )
    if not isinstance(getattr(module, "top_k", None), int) or _routed_experts(module) is None:
        return f"{name} does not name its top_k and its number of experts (top_k, num_experts)"
    return None


class _ForcedTopK(TorchFunctionMode):
    """Active during one router's forward: the ``torch.topk`` that selects its experts (``k`` =
    top_k over the last dimension of a [tokens, experts] tensor) returns ``ids`` at ``rows``
    instead of its own choice, with the top-k input's values at those ids; other rows, and every
    other call, are left as they are. A row forced to the set it chose itself keeps the top-k's
    own output (the same order, so the forward is bit for bit the free one)."""

    def __init__(self, router: str, rows: torch.Tensor, ids: torch.Tensor, top_k: int, n_experts: int):
        super().__init__()
        self.router, self.rows, self.ids = router, rows, ids
        self.top_k, self.n_experts = top_k, n_experts
        self.matched = 0

    def _selects_experts(self, given: dict) -> bool:
        x = given.get("input")
        return (
            isinstance(x, torch.Tensor)
            and x.dim() == 2
            and x.shape[-1] == self.n_experts
            and given.get("k") == self.top_k
            and given.get("dim", -1) in (-1, 1)
            and bool(given.get("largest", True))
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", None) != "topk":
            return out
        given = dict(zip(_TOPK_ARGS, args)) | kwargs
        if not self._selects_experts(given):
            return out
        self.matched += 1
        x, (values, indices) = given["input"], out
        if len(self.rows) and int(self.rows.max()) >= x.shape[0]:
            raise ValueError(
                f"{self.router}: row {int(self.rows.max())} forced, but the router scores {x.shape[0]} rows"
            )
        own = indices.index_select(0, self.rows)
        ids = self.ids.to(indices.device)
        differ = (own.sort(dim=-1).values != ids.sort(dim=-1).values).any(dim=-1)
        if not bool(differ.any()):
            return out
        rows, ids = self.rows[differ], ids[differ]
        forced = x.index_select(0, rows).gather(-1, ids)
        if given.get("sorted", True):  # the order a sorted top-k would give them
            order = forced.argsort(dim=-1, descending=True, stable=True)
            ids, forced = ids.gather(-1, order), forced.gather(-1, order)
        values, indices = values.clone(), indices.clone()
        values[rows], indices[rows] = forced.to(values.dtype), ids
        return torch.return_types.topk((values, indices))


class ForcedRouting:
    """Forwards run inside :meth:`force` send chosen rows to given experts in every MoE layer:
    rollout routing replay (R3). Each router computes its scores as usual; a
    :class:`torch.overrides.TorchFunctionMode`, entered by a forward pre-hook of the router and
    left by its forward hook, replaces the top-k that selects its experts (see
    :func:`replay_refusal` for which routers fit, and why)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.layers = [layer for layer, _ in self.routers]
        # why this model's routing cannot be replayed (None: it can, or it has no routers)
        self.unavailable = next((why for _, module in self.routers if (why := replay_refusal(module))), None)

    @property
    def active(self) -> bool:
        return bool(self.routers)

    @contextmanager
    def force(self, rows: torch.Tensor, experts: torch.Tensor) -> Iterator[None]:
        """Forwards in this block route ``rows`` (int64 [n]: indices into each router's input, the
        forward's tokens flattened row-major over the batch) to ``experts`` (int [n, moe layers,
        k], layers in :attr:`layers` order); every other row routes freely."""
        if self.unavailable:
            raise ValueError(f"routing cannot be forced: {self.unavailable}")
        if experts.dim() != 3 or experts.shape[:2] != (len(rows), len(self.routers)):
            raise ValueError(
                f"forced experts of shape {tuple(experts.shape)}; expected [{len(rows)} rows, "
                f"{len(self.routers)} MoE layers, top-k]"
            )
        if not len(rows):
            yield
            return
        rows = rows.to(torch.int64)
        active: dict[int, _ForcedTopK] = {}
        handles = []
        for slot, (layer, module) in enumerate(self.routers):
            top_k, n_experts = int(module.top_k), int(_routed_experts(module) or 0)
            ids = experts[:, slot].to(torch.int64)
            if ids.shape[-1] != top_k:
                raise ValueError(f"{len(ids[0])} forced experts per row; MoE layer {layer} routes to top-{top_k}")
            if int(ids.min()) < 0 or int(ids.max()) >= n_experts:
                raise ValueError(f"forced expert ids outside [0, {n_experts}) in MoE layer {layer}")
            if top_k > 1 and bool((ids.sort(dim=-1).values.diff(dim=-1) == 0).any()):
                raise ValueError(f"a row is forced to one expert twice in MoE layer {layer}")
            name = f"{type(module).__name__} of layer {layer}"
            handles.append(
                module.register_forward_pre_hook(self._enter(slot, name, rows, ids, top_k, n_experts, active))
            )
            handles.append(module.register_forward_hook(self._leave(slot, name, top_k, n_experts, active)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for mode in active.values():  # a forward that raised inside a router
                mode.__exit__(None, None, None)

    @staticmethod
    def _enter(slot, name, rows, ids, top_k, n_experts, active):
        def pre_hook(module, args):
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), rows.device)
            mode = _ForcedTopK(name, rows.to(device), ids.to(device), top_k, n_experts)
            mode.__enter__()
            active[slot] = mode

        return pre_hook

    @staticmethod
    def _leave(slot, name, top_k, n_experts, active):
        def hook(module, args, output):
            mode = active.pop(slot)
            mode.__exit__(None, None, None)
            if mode.matched != 1:
                raise ValueError(
                    f"routing cannot be forced: {name} made {mode.matched} top-{top_k} selections over its "
                    f"{n_experts} experts in one forward, where replay needs exactly one to replace"
                )

        return hook


def check_forced_routing(model: torch.nn.Module, input_ids: torch.Tensor) -> str | None:
    """Why routing replay does not work on ``model`` (None: it does), from two forwards of
    ``input_ids`` (one sequence, [1, T]) forced at every position: to the model's own routing,
    which must reproduce its logits bit for bit, and to other experts (each id + 1), which every
    MoE layer must then use. Call it without autograd."""
    replay = ForcedRouting(model)
    if not replay.active:
        return "the model has no MoE routers"
    if replay.unavailable:
        return replay.unavailable
    recorder = RouterRecorder(model)
    rows = torch.arange(input_ids.shape[-1], device=input_ids.device)
    n_experts = min(int(_routed_experts(module) or 0) for _, module in replay.routers)
    try:
        with recorder:
            free = model(input_ids=input_ids, use_cache=False).logits
            own = recorder.take()
            with replay.force(rows, own):
                again = model(input_ids=input_ids, use_cache=False).logits
            recorder.take()
            other = (own.to(torch.int64) + 1) % n_experts
            with replay.force(rows, other):
                model(input_ids=input_ids, use_cache=False)
            took = recorder.take()
    except ValueError as exc:
        return str(exc)
    if not torch.equal(free, again):
        moved = float((free.float() - again.float()).abs().max())
        return f"forcing {type(model).__name__}'s own routing moved its logits (max {moved:.3g})"
    if not torch.equal(took.to(torch.int64), other.sort(dim=-1).values):
        return f"{type(model).__name__}'s MoE layers did not route to the forced experts"
    return None
