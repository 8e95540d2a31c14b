"""The gated RMSNorm after a Gated DeltaNet layer (HF's RMSNormGated): each head's output normed, scaled by the
weight, times silu(z), one (token, head) row a program. It rounds to the model dtype where HF's eager code does
(the normed value, its product with the weight), so it matches the torch twin, GatedDeltaNet._gated_norm, up to the
order of the squared sum: one launch in place of the twin's ten."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.kernels.rounding import round_to


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, heads, stride_zt, stride_zh, n, eps,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)  # token * heads + head
    token, head = row // heads, row % heads
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scaled = round_to(round_to(x32 * inv_rms, dtype) * w, dtype)
    g = tl.load(z_ptr + token * stride_zt + head * stride_zh + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (scaled * (g * tl.sigmoid(g))).to(dtype), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H, D] contiguous, z [T, H, D] (its token and head strides free: a slice of a projection's rows),
    weight [D] -> [T, H * D] in x's dtype."""
    tokens, heads, n = x.shape
    assert x.is_contiguous() and z.stride(2) == 1 and weight.is_contiguous()
    out = torch.empty(tokens, heads * n, dtype=x.dtype, device=x.device)
    if tokens:
        _gated_rms_norm_kernel[(tokens * heads,)](x, z, weight, out, heads, z.stride(0), z.stride(1), n, eps,
                                                  BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 2048 else 8,
                                                  **pdl_launch(x.device))
    return out
