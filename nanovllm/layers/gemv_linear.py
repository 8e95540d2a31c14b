"""The CUDA linear method for bf16/fp16: Triton GEMV for small batches, the CUDA one-row GEMV for bs=1 decode,
cuBLAS above. CUDA only: imported where the ModelRunner picks it, so that the CPU path never imports Triton."""
import torch
from torch import nn

from nanovllm.kernels import gemv_one_row
from nanovllm.kernels.gemv import GEMV_ROWS, gemv
from nanovllm.layers.linear import UnquantizedLinearMethod

__all__ = ["GEMV_ROWS", "TritonGemvLinearMethod"]


class TritonGemvLinearMethod(UnquantizedLinearMethod):
    """CUDA, bf16/fp16: a Triton GEMV for batches of up to GEMV_ROWS (64) rows, where reading the weight is the
    whole cost (3-20% faster than cuBLAS at Qwen3-0.6B's and Llama-3-8B's layer shapes on the H100, up to 25% at
    17-64 rows; a one-off sweep, scripts/gemv_sweep.py, in git history at 248c748); F.linear (cuBLAS) for larger
    batches, and as its reference twin. One row (bs=1 decode) goes to the CUDA one-row GEMV where its weight fits it,
    with the RMSNorm before the product (and SiLU-and-mul behind a stacked gate_up, or in front of down_proj) fused
    in."""

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 1 and _takes_one_row_kernel(layer, x):
            y, _ = gemv_one_row.gemv_one_row(x, layer.weight, layer.bias, out=out)
        elif rows > GEMV_ROWS:
            return super().apply(layer, x, out)
        else:
            y = gemv(x.reshape(rows, x.shape[-1]), layer.weight, layer.bias, out=out)
        return y if out is not None else y.view(*x.shape[:-1], y.shape[-1])

    def apply_silu_and_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        if gate_up.numel() != gate_up.shape[-1] or not _takes_one_row_kernel(layer, gate_up):
            return None
        out, _ = gemv_one_row.gemv_one_row(gate_up, layer.weight, layer.bias, mode="silu_mul")
        return out.view(*gate_up.shape[:-1], out.shape[-1])

    def apply_add_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                           norm: nn.Module, silu_and_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        if x.numel() != x.shape[-1] or not _takes_one_row_kernel(layer, x, residual, norm.weight,
                                                                silu_out=silu_and_mul):
            return None
        mode = "add_norm_silu" if silu_and_mul else "add_norm"
        out, residual = gemv_one_row.gemv_one_row(x, layer.weight, layer.bias, mode, residual, norm.weight, norm.eps)
        return out.view(*x.shape[:-1], out.shape[-1]), residual.view(x.shape)


def _takes_one_row_kernel(layer: nn.Module, *tensors: torch.Tensor | None, silu_out: bool = False) -> bool:
    """Whether one row goes to the CUDA one-row kernel: its weight fits it (decided once a layer, per output
    kind) and the row's tensors are contiguous, of the weight's dtype."""
    if not hasattr(layer, "one_row_kernel"):
        layer.one_row_kernel = {kind: gemv_one_row.fits(layer.weight, kind) for kind in (False, True)}
    return layer.one_row_kernel[silu_out] and all(t is None or (t.is_contiguous() and t.dtype == layer.weight.dtype)
                                                  for t in tensors)
