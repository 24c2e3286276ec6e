"""Padding-free ("varlen") attention on top of PyTorch SDPA, for packed reference forwards.

A packed row holds many sequences. transformers' plain ``sdpa`` path handles that with a dense
[T x T] block-diagonal mask, which costs O(T^2) time and memory for the whole row and rules out
SDPA's causal fast path. Trainers on GPUs use flash-attention's varlen kernels instead, which
attend within each sequence only. This module gives the same semantics with SDPA: the packed row
is cut at the sequence boundaries (``cu_seq_lens_q``, the name flash-attention uses) and each
sequence runs causal SDPA on its own slice. It is registered with transformers'
``AttentionInterface`` under :data:`VARLEN_SDPA`; transformers builds no mask for it.
"""

from __future__ import annotations

import itertools

import torch

VARLEN_SDPA = "mismatch_probe_varlen_sdpa"
_registered = False


def _varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if kwargs.get("s_aux") is not None:  # attention sinks: SDPA has no term for them
        raise ValueError(f"{VARLEN_SDPA} cannot run attention sinks (s_aux); use eager attention")
    if kwargs.get("softcap") is not None:  # soft-capped scores (gemma2): SDPA has no term for them either
        raise ValueError(f"{VARLEN_SDPA} cannot soft-cap attention scores (softcap); use eager attention")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{VARLEN_SDPA} is for full-sequence forwards without a KV cache")
    # from the shapes, not module.num_key_value_groups: Ulysses hands over a share of the heads
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if cu_seq_lens_q is None:  # no boundaries given: each row is one whole sequence
        cu_seq_lens_q = torch.tensor([0, query.shape[2]])
    elif query.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA} takes sequence boundaries for one packed row only")
    # value heads may be narrower than query/key heads (multi-head latent attention)
    out = query.new_empty((*query.shape[:3], value.shape[-1]))
    bounds = cu_seq_lens_q.tolist()
    for a, b in itertools.pairwise(bounds):
        n = b - a
        mask, causal = None, True
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=query.device)
            diff = i[:, None] - i[None, :]
            mask, causal = (diff >= 0) & (diff < sliding_window), False
        out[:, :, a:b] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            attn_mask=mask,
            is_causal=causal,
            scale=scaling,
        )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make :data:`VARLEN_SDPA` a valid ``attn_implementation`` (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN_SDPA, _varlen_sdpa)
        _registered = True
    return VARLEN_SDPA
