"""RMSNorm, optionally after a residual add, one row per program. Every rounding to the model dtype happens
where HF's eager code rounds (sum, normalized value, product with the weight), so bf16 results match the
plain torch twin, layers.layernorm.rms_norm, bit for bit up to the order of the squared-sum reduction."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.kernels.rounding import round_to


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_ptr + row * stride_res + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = round_to(x32 * inv_rms, dtype) * w
    tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [rows, n] (rows may be strided). Without residual returns the normed rows; with it, adds the residual
    into `residual` in place (the next residual) and returns (normed, residual)."""
    x2 = x.reshape(-1, x.shape[-1])
    assert x2.stride(-1) == 1
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = residual.view(-1, x.shape[-1]) if residual is not None else x2
    n = x.shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight, out, x2.stride(0), res2.stride(0), out.stride(0), n, eps,
                                     HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
                                     num_warps=4 if n <= 2048 else 8, **pdl_launch(x.device))
    out = out.view(x.shape)
    return out if residual is None else (out, residual)
