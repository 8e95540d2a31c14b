from torch import nn


class CustomOp(nn.Module):
    """A layer with a plain torch forward (forward_native: the reference, and the CPU path) and a fused Triton
    forward. The ModelRunner turns `use_triton` on for CUDA models that run the Triton attention backend."""

    use_triton = False

    def forward(self, *args, **kwargs):
        if self.use_triton:
            return self.forward_triton(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        raise NotImplementedError
