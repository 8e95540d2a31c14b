"""Linear layers. A layer owns its shape and shard layout; a LinearMethod owns how the weight is
stored and multiplied, which is the seam where quantized formats plug in. With tensor parallelism (distributed/)
a column-parallel layer holds its rank's rows of each output shard, a row-parallel one its rank's input columns,
and sums its output over the ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.parallel_state import all_reduce, tp_rank, tp_size


class LinearMethod:
    def create_weights(self, layer: "LinearBase", bias: bool):
        raise NotImplementedError

    def load_weight(self, layer: "LinearBase", param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        """Copy a checkpoint tensor into param (the rows of shard_id when the layer stacks several)."""
        target = param.data
        if shard_id is not None:
            offset, size = layer.output_shards[shard_id]
            target = target.narrow(0, offset, size)
        loaded = layer.rank_part(loaded, target.shape)
        if target.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module):
        """Repack the loaded weight for this method's kernel (no-op by default)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """layer(x); with `out` ([rows, output_size], rows contiguous), written there: a CUDA graph's static
        output, which spares a copy."""
        raise NotImplementedError

    def apply_silu_and_mul(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        """layer(silu(gate) * up) in one kernel where this method has one for this input; None: run them apart."""
        return None

    def apply_add_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                           norm: nn.Module, silu_and_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(layer(norm(x + residual)), x + residual) in one kernel where this method has one; None: run them
        apart. silu_and_mul: the layer's output is a stacked [gate | up], and the kernel returns silu(gate) * up."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: "LinearBase", bias: bool):
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(layer.output_size), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return F.linear(x, layer.weight, layer.bias)
        x2d = x.reshape(-1, x.shape[-1])  # the cuBLAS calls F.linear makes, into `out`
        if layer.bias is None:
            return torch.mm(x2d, layer.weight.t(), out=out)
        return torch.addmm(layer.bias, x2d, layer.weight.t(), out=out)


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    """fp32 on CPU: oneDNN's blocked weight layout, 1.5-2.5x faster than F.linear for decode batches here.
    F.linear (UnquantizedLinearMethod) is its reference twin."""

    @staticmethod
    def available() -> bool:
        """Present in this torch build and exact to fp32 rounding here (oneDNN may be set to compute fp32 in
        bf16 or tf32 on some CPUs, which would break fidelity)."""
        try:
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(256, 512, generator=g), torch.randn(33, 512, generator=g)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            return torch.allclose(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
        except (AttributeError, RuntimeError):
            return False

    def process_weights_after_loading(self, layer: nn.Module):
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.data, 32)

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), layer.packed_weight, layer.bias,
                                               "none", [], "")
        return y.view(*shape[:-1], y.shape[-1]) if out is None else out.copy_(y)


class LinearBase(nn.Module):
    """y = x W^T (+ b). `output_shards` names the row ranges that separate HF tensors fill."""

    tp_dim: int | None = None  # tensor parallel: 0 the rank holds some output rows, 1 some input columns

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 shard_ids: list | None = None, linear_method: LinearMethod | None = None):
        """Sizes are this rank's (the whole layer's without tensor parallelism)."""
        super().__init__()
        self.input_size = input_size
        self.output_size = sum(output_sizes)
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        ids = shard_ids if shard_ids is not None else list(range(len(output_sizes)))
        self.output_shards = {sid: (off, size) for sid, off, size in zip(ids, offsets, output_sizes)}
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        self.linear_method.load_weight(self, param, loaded, shard_id)

    def rank_part(self, loaded: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """This rank's part of a checkpoint tensor or quantized weight (all of it without tensor parallelism; as it is
        where it has this rank's size already: a tied LM head's table). A row-parallel bias is added once: by rank 0,
        before the sum over ranks."""
        if self.tp_dim is None or tp_size() == 1:
            return loaded
        if len(loaded.shape) == 1 and self.tp_dim == 1:
            return loaded if tp_rank() == 0 else torch.zeros_like(loaded)
        dim = self.tp_dim if len(loaded.shape) > 1 else 0
        if loaded.shape[dim] == shape[dim]:
            return loaded
        return loaded.narrow(dim, tp_rank() * shape[dim], shape[dim])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kw):
        super().__init__(input_size, [output_size], bias, shard_ids=[None], **kw)


class RowParallelLinear(LinearBase):
    """o_proj, down_proj: each rank multiplies its input columns, and the outputs sum over the ranks."""
    tp_dim = 1

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kw):
        """input_size: the whole layer's."""
        super().__init__(input_size // tp_size(), [output_size], bias, shard_ids=[None], **kw)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of an output computed outside forward (a fused kernel of the linear method)."""
        return all_reduce(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.linear_method.apply(self, x))


class MergedColumnLinear(LinearBase):
    """Several projections of the same input stacked along the output (gate_up_proj); each rank holds its rows of
    each."""
    tp_dim = 0

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw):
        """output_sizes: the whole layer's."""
        super().__init__(input_size, [size // tp_size() for size in output_sizes], bias, **kw)


class QKVLinear(LinearBase):
    tp_dim = 0

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, **kw):
        """num_heads, num_kv_heads: this rank's."""
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias,
                         shard_ids=["q", "k", "v"], **kw)
