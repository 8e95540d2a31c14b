"""GGUF weights kept quantized in memory (quantization="gguf"): each projection holds its file's blocks
(quant.gguf_weight.GGUFWeight) and multiplies through the Triton dequant-GEMV for a few rows on CUDA, else through
its torch twin (dequantize a slice of rows, then a dense matmul). On CPU the blocks become torch's CPU layouts at
load instead (quant/cpu_int4.py). A layer whose type has no kernel here is
dequantized at load, and the log says so in the table of which kernel serves which layer.

quantization="int4" runs the same path: each 16-bit projection is quantized at load into INT4_G128 blocks
(quant/quantize.py), a format the kernels read as Q4_1; its embedding and LM head stay dense."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import LinearMethod, UnquantizedLinearMethod
from nanovllm.quant.base_config import QuantizationConfig, rows_per_chunk
from nanovllm.quant.cpu_int4 import INT4_TYPES, Int4Weight, cpu_weight
from nanovllm.quant.gguf_formats import BLOCK_FORMATS, INT4_G128
from nanovllm.quant.gguf_weight import GGUFWeight
from nanovllm.quant.quantize import quantize_int4


class GGUFConfig(QuantizationConfig):
    """Which GGUF types stay quantized on this device and how they are multiplied. int4: dense checkpoint weights
    are quantized to INT4_G128 at load (and the embedding and LM head stay dense)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, use_kernels: bool, int4: bool = False):
        self.device, self.dtype, self.int4 = device, dtype, int4
        self.quantize_embeddings = not int4
        self.gemv = self.one_row = None
        if device.type == "cuda":
            from nanovllm.kernels import gguf_gemv  # CUDA only: the CPU path imports no Triton

            self.kept_types = gguf_gemv.KERNEL_TYPES
            if use_kernels:
                from nanovllm.kernels import gguf_gemv_one_row

                self.gemv, self.gemv_rows = gguf_gemv.gguf_gemv, gguf_gemv.MAX_ROWS
                self.dequantize = gguf_gemv.gguf_dequantize
                self.one_row = gguf_gemv_one_row if gguf_gemv_one_row.why_off(device) is None else None
        else:  # CPU: every type is kept, in the form quant/cpu_int4.py gives it (CpuGGUFLinearMethod)
            self.kept_types = tuple(name for name, fmt in BLOCK_FORMATS.items() if fmt.block_size > 1)

    def linear_method(self) -> LinearMethod:
        return CpuGGUFLinearMethod(self) if self.device.type == "cpu" else GGUFLinearMethod(self)

    def describe(self) -> str:
        what = "int4 (INT4_G128) weights quantized at load" if self.int4 else "GGUF weights kept quantized"
        return f"{what} on {self.device.type}"

    def path(self, type_name: str) -> str:
        if type_name not in self.kept_types:
            return f"{type_name}: no kernel here, dequantized at load"
        if self.gemv is not None:
            one_row = "CUDA GEMV for one fp16 row, " if self.one_row is not None and type_name in self.one_row.TYPES \
                else ""
            return (f"{type_name}: {one_row}Triton dequant-GEMV / GEMM up to {self.gemv_rows} rows, "
                    "Triton dequantize + cuBLAS above")
        return f"{type_name}: torch dequantize + matmul"


class GGUFLinearMethod(LinearMethod):
    """A linear layer over GGUF blocks. Until loading ends the layer's `weight` is a meta placeholder of the dense
    shape and each shard's blocks wait in `gguf_shards`; then `qweights` holds (first output row, GGUFWeight)
    pieces on the device: one piece where the shards share a type (stacked), one a shard where they differ."""

    def __init__(self, config: GGUFConfig):
        self.config = config

    def create_weights(self, layer: nn.Module, bias: bool):
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, device="meta"),
                                    requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(layer.output_size), requires_grad=False) if bias else None
        layer.gguf_shards = {}
        group = INT4_G128.block_size
        if self.config.int4 and layer.input_size % group:
            raise ValueError(f"quantization='int4' quantizes rows in groups of {group}, but a layer of this model "
                             f"has rows of {layer.input_size} weights; use quantization='int8' or 'fp8'")

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id=None):
        if param is not layer.weight:  # the bias: dense in every GGUF file
            return super().load_weight(layer, param, loaded, shard_id)
        offset, size = layer.output_shards[shard_id]
        loaded = layer.rank_part(loaded, (size, layer.input_size))
        if tuple(loaded.shape) != (size, layer.input_size):
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {(size, layer.input_size)}")
        if self.config.int4:
            loaded = quantize_int4(loaded.to(self.config.device))
        layer.gguf_shards[shard_id] = loaded

    @staticmethod
    def take_pieces(layer: nn.Module) -> list[tuple[int, GGUFWeight | torch.Tensor]]:
        """The layer's loaded shards as (first output row, weight), in row order; the layer lets them go."""
        pieces = sorted(((layer.output_shards[sid][0], w) for sid, w in layer.gguf_shards.items()),
                        key=lambda piece: piece[0])
        del layer.gguf_shards
        return pieces

    def process_weights_after_loading(self, layer: nn.Module) -> str:
        """Returns the path that serves the layer, for the load log."""
        pieces = self.take_pieces(layer)
        types = {w.type_name if isinstance(w, GGUFWeight) else "dense" for _, w in pieces}
        path = "; ".join(self.config.path(t) if t != "dense" else "F32/F16 in the file: dense" for t in sorted(types))
        if types <= set(self.config.kept_types):
            layer.qweights = _stack_same_types(pieces, self.config.weights_device)
            layer.weight = None
            return path
        dense = torch.cat([w.dequantize() if isinstance(w, GGUFWeight) else w for _, w in pieces])
        layer.weight = nn.Parameter(dense.to(self.config.weights_device, self.config.dtype), requires_grad=False)
        layer.linear_method = UnquantizedLinearMethod()
        return path

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        x2d = x.reshape(rows, x.shape[-1])
        y = torch.empty(rows, layer.output_size, dtype=x.dtype, device=x.device) if out is None else out
        for offset, weight in layer.qweights:
            self._matmul(x2d, weight, y if len(layer.qweights) == 1 else y[:, offset:offset + weight.shape[0]])
        if layer.bias is not None:
            y += layer.bias
        return y if out is not None else y.view(*x.shape[:-1], layer.output_size)

    def _matmul(self, x: torch.Tensor, weight: GGUFWeight, out: torch.Tensor):
        if self.config.gemv is not None:
            one_row = self.config.one_row
            if one_row is not None and out.is_contiguous() and one_row.serves(x, weight):
                one_row.gguf_gemv_one_row(x, weight, out=out)
            elif x.shape[0] <= self.config.gemv_rows:
                self.config.gemv(x, weight, out=out)
            elif out.is_contiguous():
                torch.mm(x, self.config.dequantize(weight, x.dtype).t(), out=out)
            else:
                out.copy_(F.linear(x, self.config.dequantize(weight, x.dtype)))
            return
        n, k = weight.shape
        step = rows_per_chunk(x, k)
        for start in range(0, n, step):
            rows = weight.map_rows(lambda field: field[start:start + step])
            out[:, start:start + rows.shape[0]] = F.linear(x, rows.dequantize().to(x.dtype))


class CpuGGUFLinearMethod(GGUFLinearMethod):
    """quantization="gguf" on CPU: loaded as GGUFLinearMethod loads (the shards' blocks wait in `gguf_shards`),
    then each piece of rows in its CPU form (`cpu_pieces`: first row, and Int4Weight, bf16, or the file's dense
    tensor; quant/cpu_int4.py)."""

    def process_weights_after_loading(self, layer: nn.Module) -> str:
        pieces = self.take_pieces(layer)
        layer.cpu_pieces = [(offset, cpu_weight(w)) for offset, w in pieces]
        layer.weight = None
        tied = getattr(layer, "tied_embedding", None)
        if tied is not None and len(layer.cpu_pieces) == 1 and isinstance(layer.cpu_pieces[0][1], torch.Tensor):
            tied.share_table(layer.cpu_pieces[0][1])  # one bf16 table for both, not the blocks beside it
        types = sorted({w.type_name if isinstance(w, GGUFWeight) else "dense" for _, w in pieces})
        return "; ".join(f"{t}: int4 packed, torch's CPU int4 matmul" if t in INT4_TYPES else
                         "F32/F16 in the file: dense" if t == "dense" else f"{t}: dequantized to bf16 at load"
                         for t in types)

    def apply(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        parts = [w.matmul(x2d) if isinstance(w, Int4Weight) else F.linear(x2d.to(w.dtype), w)
                 for _, w in layer.cpu_pieces]
        y = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).to(x.dtype)
        if layer.bias is not None:
            y += layer.bias
        if out is not None:
            out.copy_(y)
            return out
        return y.view(*x.shape[:-1], layer.output_size)


def _stack_same_types(pieces: list[tuple[int, GGUFWeight]], device) -> list[tuple[int, GGUFWeight]]:
    """Adjacent pieces of one type stacked into one, each moved to the device."""
    groups: list[tuple[int, list[GGUFWeight]]] = []
    for offset, weight in pieces:
        if groups and groups[-1][1][-1].type_name == weight.type_name:
            groups[-1][1].append(weight)
        else:
            groups.append((offset, [weight]))
    return [(offset, (GGUFWeight.cat(ws) if len(ws) > 1 else ws[0]).to(device)) for offset, ws in groups]
