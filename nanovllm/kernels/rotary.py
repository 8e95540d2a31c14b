"""Neox rotary embedding applied in place to q and k, with Qwen3's per-head RMSNorm fused in front when given.
One program per token rotates all its q and k heads as [heads, head_dim / 2] tiles (a program per head and
token was 6x slower on 8K-token prefills: 200K one-warp programs). Twin: layers.rotary_embedding.RotaryEmbedding
.forward_native (and RMSNorm)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.kernels.rounding import round_to


@triton.jit
def _rope_heads(ptr, stride_h, num_heads, w_ptr, cos, sin, eps, half, HAS_NORM: tl.constexpr,
                HEADS: tl.constexpr, BLOCK: tl.constexpr):
    heads = tl.arange(0, HEADS)
    offs = tl.arange(0, BLOCK)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < half)
    first = ptr + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * half) + eps)
        w1 = tl.load(w_ptr + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
        a = round_to(round_to(a * inv_rms[:, None], dtype) * w1, dtype)
        b = round_to(round_to(b * inv_rms[:, None], dtype) * w2, dtype)
    out1 = round_to(a * cos, dtype) + round_to(-(b * sin), dtype)
    out2 = round_to(b * cos, dtype) + round_to(a * sin, dtype)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, num_q_heads, num_k_heads, half, eps, HAS_NORM: tl.constexpr, Q_HEADS: tl.constexpr,
                   K_HEADS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    # cos/sin tables: [positions, 2 * half] with equal halves, already in the model dtype as HF casts them
    cos = tl.load(cos_ptr + pos * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
    _rope_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, qw_ptr, cos, sin, eps, half, HAS_NORM, Q_HEADS,
                BLOCK)
    _rope_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, kw_ptr, cos, sin, eps, half, HAS_NORM, K_HEADS,
                BLOCK)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """q: [T, H, D], k: [T, Hk, D] (strided views of a fused qkv are fine), rotated in place and returned.
    cos, sin: [max_position, D] in q's dtype."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] % 2 == 0
    num_tokens, num_heads, head_dim = q.shape
    has_norm = q_norm_weight is not None
    half = head_dim // 2
    q_heads, k_heads = triton.next_power_of_2(num_heads), triton.next_power_of_2(k.shape[1])
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q_norm_weight if has_norm else cos, k_norm_weight if has_norm else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_heads, k.shape[1], half, eps,
        HAS_NORM=has_norm, Q_HEADS=q_heads, K_HEADS=k_heads, BLOCK=triton.next_power_of_2(half),
        num_warps=4 if q_heads * half >= 1024 else 1, **pdl_launch(q.device))
    return q, k
