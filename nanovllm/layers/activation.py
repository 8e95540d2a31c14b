import torch
import torch.nn.functional as F

from nanovllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for the stacked gate_up projection."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels.activation import silu_and_mul

        return silu_and_mul(x)
