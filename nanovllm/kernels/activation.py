"""silu(gate) * up over the stacked gate_up projection, rounding where the twin layers.activation rounds."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.kernels.rounding import round_to


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in their dtype, rounding where the twin rounds."""
    g32 = gate.to(tl.float32)
    act = round_to(g32 / (1.0 + tl.exp(-g32)), gate.dtype)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, silu_mul(gate, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2d] -> [..., d]."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(-1) == 1
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block,
                                                                **pdl_launch(x.device))
    return out.view(*x.shape[:-1], d)
