"""Neox rotary embedding applied in place to q and k, with Qwen3's per-head RMSNorm fused in front when given.
One program per (token, head). Twin: layers.rotary_embedding.RotaryEmbedding.forward_native (and RMSNorm)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.kernels.rounding import round_to


@triton.jit
def _rope_head(ptr, w_ptr, cos, sin, eps, half, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    x1 = tl.load(ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(ptr + half + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * half) + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        a = round_to(round_to(a * inv_rms, dtype) * w1, dtype)
        b = round_to(round_to(b * inv_rms, dtype) * w2, dtype)
    out1 = round_to(a * cos, dtype) + round_to(-(b * sin), dtype)
    out2 = round_to(b * cos, dtype) + round_to(a * sin, dtype)
    tl.store(ptr + offs, out1.to(dtype), mask=mask)
    tl.store(ptr + half + offs, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, num_q_heads, half, eps, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    # cos/sin tables: [positions, 2 * half] with equal halves, already in the model dtype as HF casts them
    cos = tl.load(cos_ptr + pos * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)
    if head < num_q_heads:
        _rope_head(q_ptr + token * stride_qt + head * stride_qh, qw_ptr, cos, sin, eps, half, HAS_NORM, BLOCK)
    else:
        _rope_head(k_ptr + token * stride_kt + (head - num_q_heads) * stride_kh, kw_ptr, cos, sin, eps, half,
                   HAS_NORM, BLOCK)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """q: [T, H, D], k: [T, Hk, D] (strided views of a fused qkv are fine), rotated in place and returned.
    cos, sin: [max_position, D] in q's dtype."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] % 2 == 0
    num_tokens, num_heads, head_dim = q.shape
    has_norm = q_norm_weight is not None
    half = head_dim // 2
    _rotary_kernel[(num_tokens, num_heads + k.shape[1])](
        q, k, positions, cos, sin, q_norm_weight if has_norm else cos, k_norm_weight if has_norm else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_heads, half, eps,
        HAS_NORM=has_norm, BLOCK=triton.next_power_of_2(half), num_warps=1, **pdl_launch(q.device))
    return q, k
