import torch
from torch import nn

from nanovllm.layers.custom_op import CustomOp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's order of operations: normalize in fp32, cast back, then scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: add it first and also return the sum, the next residual."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One kernel; the sum is written into `residual` in place."""
        from nanovllm.kernels.rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, self.weight, self.eps, residual)
