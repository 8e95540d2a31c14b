"""16-bit weights quantized at load (quantization="fp8" / "int8" / "int4", vLLM's names), in plain torch: each
function takes a [N, K] weight and gives what the kernels read, and its dequantization is the reference twin of
those kernels.

- fp8: e4m3 weights, one fp32 scale an output channel (row): w = q * scale, |q| <= 448.
- int8: symmetric int8 weights, one fp32 scale a row: w = q * scale, |q| <= 127.
- int4: affine 4-bit in groups of 128 weights along the row (gguf_formats.INT4_G128): w = d * q + m, q in 0..15."""
import torch

from nanovllm.quant.gguf_formats import INT4_G128
from nanovllm.quant.gguf_weight import GGUFWeight

CHANNEL_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}  # the largest |q| of each per-channel type


def quantize_per_channel(weight: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] in qdtype, scale fp32 [N]) with weight ~= q * scale[:, None]; the row's largest |w| maps to the
    type's largest q (a zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / CHANNEL_QMAX[qdtype], torch.ones_like(amax))
    q = w / scale[:, None]
    q = q.round().clamp(-127, 127).to(qdtype) if qdtype == torch.int8 else q.clamp(-448, 448).to(qdtype)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: the twin of the fp8 / int8 kernels."""
    return q.float() * scale[:, None]


def quantize_int4(weight: torch.Tensor) -> GGUFWeight:
    """An INT4_G128 weight: each group of 128 spans its min..max in 16 steps, with d and m rounded to fp16 first
    so that the quants are chosen for the scale the kernels use."""
    n, k = weight.shape
    group = INT4_G128.block_size
    if k % group:
        raise ValueError(f"int4 quantizes rows in groups of {group} weights; a row of {k} is not whole groups")
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    d = ((high - low) / 15).half()
    m = low.half()
    step = torch.where(d > 0, d.float(), torch.ones_like(low))
    q = ((w - m.float()[..., None]) / step[..., None]).round().clamp(0, 15).to(torch.uint8)
    half = group // 2
    qs = q[..., :half] | (q[..., half:] << 4)
    return GGUFWeight(INT4_G128.name, (n, k), {"d": d, "m": m, "qs": qs.reshape(n, -1)})
