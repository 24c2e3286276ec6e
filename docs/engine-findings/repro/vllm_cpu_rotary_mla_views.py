"""vLLM's CPU rotary-embedding kernel on the strided views multi-head latent attention hands it
(docs/engine-findings/vllm-cpu-deepseek-v3-mla.md), against the rotation it implements.

    .venv/bin/python docs/engine-findings/repro/vllm_cpu_rotary_mla_views.py

The shapes are the suite's tiny DeepSeek-V3's: 4 heads of 32 + 64 (RoPE) dimensions, kv_lora_rank
512, q_lora_rank 32. `layers/mla.py` rotates q[..., 32:] (a [T, 4, 64] view, strides (384, 96, 1))
and k_pe (a [T, 1, 64] view of the [T, 608] qkv_lora buffer) in place with torch.ops._C.rotary_embedding
when the op runs its CPU kernel (enforce_eager). Prints the max error per (token, head) of q and per
token of k_pe: bf16 rounding (below 0.02) is right, anything of order 1 is a wrong rotation.
"""

import torch
from vllm.platforms import current_platform

current_platform.import_kernels()

T, H, NOPE, ROPE = 8, 4, 32, 64
torch.manual_seed(0)
q = torch.randn(T, H, NOPE + ROPE, dtype=torch.bfloat16)
qkv_lora = torch.randn(T, 32 + 512 + ROPE, dtype=torch.bfloat16)
k_pe = qkv_lora[:, 544:].unsqueeze(1)  # strides (608, 64, 1), as mla.py makes it
positions = torch.arange(T) + 100
inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
freqs = torch.outer(torch.arange(1024).float(), inv_freq)
cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(torch.bfloat16)


def rotated(x: torch.Tensor) -> torch.Tensor:
    """GPT-J style (is_neox_style=False: interleaved pairs), in float32."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    x = x.float()
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)


if __name__ == "__main__":
    want_q, want_k = rotated(q[..., NOPE:]), rotated(k_pe)
    # control: the same values as the contiguous [tokens, heads * 64] a model without MLA passes
    q2, k2 = q[..., NOPE:].reshape(T, H * ROPE).clone(), k_pe.reshape(T, ROPE).clone()
    torch.ops._C.rotary_embedding(positions, q2, k2, ROPE, cos_sin_cache, False)
    print("control, contiguous 2-D inputs: max |kernel - rotation| of q and of k:")
    print(f"{(q2.float().view(T, H, ROPE) - want_q).abs().max():.4f} {(k2.float() - want_k[:, 0]).abs().max():.4f}")
    torch.ops._C.rotary_embedding(positions, q[..., NOPE:], k_pe, ROPE, cos_sin_cache, False)
    print("q: max |kernel - rotation| per token (rows) and head (columns)")
    print((q[..., NOPE:].float() - want_q).abs().amax(-1))
    print("k_pe: max |kernel - rotation| per token")
    print((k_pe.float() - want_k).abs().amax(-1).flatten())
