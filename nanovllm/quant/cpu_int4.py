"""GGUF weights kept quantized on CPU (quantization="gguf"), in the layouts torch's CPU kernels read: 4-bit types
(Q4_0, Q4_1, Q4_K and quantization="int4"'s INT4_G128) repacked at load for `_weight_int4pack_mm_for_cpu`
(4-bit values packed by torch; per group of 32 or 128 weights a bf16 scale and zero, w = (q - 8) scale + zero),
the other quantized types dequantized at load to bf16; tensors stored dense in the file stay as loaded. The first
two multiply bf16 activations (the CPUs here have AVX512-BF16; this kernel runs fp16 and fp32 activations ~30x
slower) and return the model's dtype.

Measured on this 2-core CI machine (torch 2.13, one matmul, us): 1536 x 576 at 1 / 4 / 16 / 64 / 256 rows: int4
28 / 47 / 178 / 685 / 2973, bf16 62 / 70 / 119 / 307 / 1089, fp32 71 / 177 / 248 / 718 / 2576 (the int4 kernel is
for few rows: past 16 its rows cost as fp32's)."""
import torch

from nanovllm.quant.gguf_formats import _k_scale_min, _nibbles
from nanovllm.quant.gguf_weight import GGUFWeight

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "INT4_G128")


def _values_and_affine(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q [N, K] 0..15, a, b [N, K / group] fp32 with w = a q + b, group) of a 4-bit weight, as gguf dequantizes it."""
    f = weight.fields
    n, k = weight.shape
    d = f["d"].float()
    if weight.type_name == "Q4_K":
        q = _nibbles(f["qs"].reshape(-1, 128), 32).reshape(n, k)
        sc, mn = _k_scale_min(f["scales"].reshape(-1, 12))
        a = (d.reshape(-1, 1) * sc.float()).reshape(n, -1)
        b = -(f["dmin"].float().reshape(-1, 1) * mn.float()).reshape(n, -1)
        return q, a, b, 32
    group = 128 if weight.type_name == "INT4_G128" else 32
    q = _nibbles(f["qs"].reshape(-1, group // 2), group // 2).reshape(n, k)
    if weight.type_name == "Q4_0":
        return q, d, -8 * d, group
    return q, d, f["m"].float(), group


class Int4Weight:
    """A 4-bit weight in torch's CPU int4 layout, packed a few MB of rows at a time (the unpacked values are 4 bytes a
    weight: a vocabulary's table whole would cost several times the file)."""

    def __init__(self, weight: GGUFWeight):
        n, k = self.shape = weight.shape
        step = max(1, (4 << 20) // k)
        packed, scales_zeros = [], []
        for start in range(0, n, step):
            q, a, b, self.group = _values_and_affine(weight.map_rows(lambda field: field[start:start + step]))
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
            scales_zeros.append(torch.stack([a, b + 8 * a], -1).to(torch.bfloat16))  # w = (q - 8) scale + zero
        self.packed = torch.cat(packed)
        self.scales_zeros = torch.cat(scales_zeros).transpose(0, 1).contiguous()  # [K / group, N, 2], the kernel's

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) @ w^T -> [M, N] bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group,
                                                         self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] as the kernel sees it: the file's weights, the scales and zeros rounded to bf16."""
        return self.matmul(torch.eye(self.shape[1])).float().t()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def cpu_weight(weight: GGUFWeight | torch.Tensor) -> "Int4Weight | torch.Tensor":
    """A loaded piece of a projection in its CPU compute form: Int4Weight, a bf16 tensor, or the dense tensor as
    the file stored it."""
    if isinstance(weight, GGUFWeight) and weight.type_name in INT4_TYPES:
        return Int4Weight(weight)
    if not isinstance(weight, GGUFWeight):  # stored dense in the file: as loaded (the model's dtype)
        return weight
    dense = torch.empty(weight.shape, dtype=torch.bfloat16)
    step = max(1, (8 << 20) // (4 * weight.shape[1]))  # 8 MB of fp32 at a time, not the whole table (a vocabulary's)
    for start in range(0, weight.shape[0], step):
        dense[start:start + step] = weight.map_rows(lambda field: field[start:start + step]).dequantize()
    return dense
