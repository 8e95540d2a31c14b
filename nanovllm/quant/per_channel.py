"""fp8 and int8 weights quantized at load with one scale an output channel (quantization="fp8" / "int8"). Each
projection holds `qweight` [N, K] (e4m3 or int8) and `weight_scale` fp32 [N], quantized shard by shard as the
checkpoint is read, so the 16-bit weights never sit on the device whole. The embedding and LM head stay dense.

Few rows (CUDA): the Triton GEMV reads the 1-byte weights and applies the scale to its fp32 sums. More rows: fp8 in
bf16 on a GPU with FP8 tensor cores quantizes the activations to e4m3 per token (dynamic scales,
kernels/fp8_quant.py) and multiplies on them (torch._scaled_mm); int8 (and fp8 in other dtypes) converts the weight
to the activations' dtype for cuBLAS and scales the product. CPU: the torch twin, a slice of rows at a time."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import LinearMethod
from nanovllm.quant.base_config import QuantizationConfig, rows_per_chunk
from nanovllm.quant.quantize import CHANNEL_QMAX, quantize_per_channel

QDTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


class PerChannelConfig(QuantizationConfig):
    def __init__(self, name: str, device: torch.device, dtype: torch.dtype, use_kernels: bool):
        self.name, self.qdtype = name, QDTYPES[name]
        self.device, self.dtype = device, dtype
        self.gemv = None
        if use_kernels:
            from nanovllm.kernels.gemv import GEMV_ROWS, gemv

            self.gemv, self.gemv_rows = gemv, GEMV_ROWS
        # torch._scaled_mm's per-row scales give bf16 out; fp16 / fp32 models take the int8 way
        self.scaled_mm = name == "fp8" and device.type == "cuda" and dtype == torch.bfloat16

    def linear_method(self) -> "PerChannelLinearMethod":
        return PerChannelLinearMethod(self)

    def describe(self) -> str:
        return f"{self.name} weights quantized at load, one scale a channel, on {self.device.type}"

    def path(self) -> str:
        many = ("e4m3 activations scaled per token, torch._scaled_mm" if self.scaled_mm else
                f"{self.name} -> {str(self.dtype).removeprefix('torch.')} + matmul, then the scale")
        few = f"Triton GEMV up to {self.gemv_rows} rows, " if self.gemv is not None else ""
        return f"{few}{many}" + (" above" if few else "")


class PerChannelLinearMethod(LinearMethod):
    """Until loading ends the layer's `weight` is a meta placeholder of the dense shape (the name the checkpoint
    fills); each shard is quantized into its rows of `qweight` / `weight_scale` as it arrives."""

    def __init__(self, config: PerChannelConfig):
        self.config = config

    def create_weights(self, layer: nn.Module, bias: bool):
        c = self.config
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, device="meta"),
                                    requires_grad=False)
        layer.register_buffer("qweight", torch.empty(layer.output_size, layer.input_size, dtype=c.qdtype,
                                                     device=c.weights_device))
        layer.register_buffer("weight_scale", torch.empty(layer.output_size, dtype=torch.float32,
                                                          device=c.weights_device))
        layer.bias = nn.Parameter(torch.empty(layer.output_size), requires_grad=False) if bias else None

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id=None):
        if param is not layer.weight:
            return super().load_weight(layer, param, loaded, shard_id)
        offset, size = layer.output_shards[shard_id]
        loaded = layer.rank_part(loaded, (size, layer.input_size))
        if tuple(loaded.shape) != (size, layer.input_size):
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {(size, layer.input_size)}")
        q, scale = quantize_per_channel(loaded.to(self.config.device), self.config.qdtype)
        layer.qweight[offset:offset + size] = q
        layer.weight_scale[offset:offset + size] = scale

    def process_weights_after_loading(self, layer: nn.Module) -> str:
        layer.weight = None
        return self.config.path()

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        x2d = x.reshape(rows, x.shape[-1])
        y = torch.empty(rows, layer.output_size, dtype=x.dtype, device=x.device) if out is None else out
        c = self.config
        if c.gemv is not None and rows <= c.gemv_rows:
            c.gemv(x2d, layer.qweight, layer.bias, out=y, scale=layer.weight_scale)
            return y if out is not None else y.view(*x.shape[:-1], layer.output_size)
        if c.scaled_mm:
            _fp8_matmul(x2d, layer.qweight, layer.weight_scale, y)
        else:
            _dequantized_matmul(x2d, layer.qweight, layer.weight_scale, y)
        if layer.bias is not None:
            y += layer.bias
        return y if out is not None else y.view(*x.shape[:-1], layer.output_size)


def per_token_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [rows, n], fp32 scales [rows, 1]): each row of x scaled to e4m3's range by its own absmax (the twin of
    kernels/fp8_quant.py)."""
    x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / CHANNEL_QMAX[torch.float8_e4m3fn]
    return (x.float() / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn), x_scale


def _fp8_matmul(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor):
    """out = x W^T on the FP8 tensor cores, x quantized per token."""
    from nanovllm.kernels.fp8_quant import per_token_fp8

    xq, x_scale = per_token_fp8(x)
    torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=x.dtype, out=out)


def _dequantized_matmul(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor):
    """out = (x q^T) * scale, q converted to x's dtype (exactly: |q| <= 448 with 3 mantissa bits, or 127); on CPU a
    slice of rows at a time, so no dense copy of the weight is ever whole."""
    n, k = qweight.shape
    step = rows_per_chunk(x, k)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        out[:, rows] = F.linear(x, qweight[rows].to(x.dtype)) * weight_scale[rows].to(x.dtype)
