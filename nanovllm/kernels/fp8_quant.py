"""Dynamic per-token FP8 quantization of activations for torch._scaled_mm (quantization="fp8", many rows): one
program a row finds its absmax and writes the row as e4m3 with scale = absmax / 448 (e4m3's largest), in one kernel
where torch takes six. Twin: quant/per_channel.per_token_fp8_reference."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, n, stride_x, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    tl.store(scale_ptr + row, scale)
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n] (rows contiguous) -> (e4m3 [rows, n], fp32 scales [rows, 1]) with x ~= q * scale."""
    rows, n = x.shape
    assert x.stride(1) == 1
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _per_token_fp8_kernel[(rows,)](x, q, scale, n, x.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(n),
                                   num_warps=4 if n <= 4096 else 8, **pdl_launch(x.device))
    return q, scale
