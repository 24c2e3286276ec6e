"""MoE routing capture: which experts each token was sent to, per MoE layer, on either side.

transformers' MoE models route through ``*TopKRouter`` modules that return
``(router_logits, router_scores, router_indices)``. Forward hooks on those modules record the
top-k expert ids; ids are sorted per token so that "same expert set" is plain row equality.

For a model token at position t, the routing that shaped its probability is the routing of the
input at t-1 (the hidden state that produced the logits). Both sides record exactly that: the
engine keeps the last input position of each forward (prefill, then each decode step); the
reference keeps the rows it scores.
"""

from __future__ import annotations

import re
from typing import Self

import torch

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _is_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.lower().endswith("topkrouter")


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
        self.routers: list[tuple[int, torch.nn.Module]] = []
        for name, module in model.named_modules():
            if _is_router(module):
                match = _LAYER.search(f".{name}.")
                self.routers.append((int(match.group(1)) if match else len(self.routers), module))
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
