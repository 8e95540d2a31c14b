"""Random weights in GGUF block types at a given mean 0 and std: random bytes whose f16 scales are set by a
calibration of each type, drawn on the GPU where there is one. synthetic_gguf.py writes files of them;
load_format="dummy" draws a mixture's experts as them (synthetic.random_weights)."""
import functools

import numpy as np
import torch

from nanovllm.quant.gguf_formats import BLOCK_FORMATS, DENSE_TYPES, dequantize
from nanovllm.quant.gguf_weight import GGUFWeight

_SCALES = ("d",)
_MINS = ("m", "dmin")  # gguf_formats.F16_FIELDS, the scale apart from the offsets


def _set_f16(blocks: np.ndarray | torch.Tensor, fmt, fields, value: float):
    value_bytes = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    if isinstance(blocks, torch.Tensor):
        value_bytes = torch.from_numpy(value_bytes.copy()).to(blocks.device)
    for name in fields:
        if name in dict(fmt.fields):
            at = fmt.offset(name)
            blocks[:, at:at + 2] = value_bytes


@functools.cache
def _calibration(type_name: str) -> tuple[float, float]:
    """(d, min) f16 field values that give random blocks of this type mean 0 and std 1: measured once a type by the
    torch dequantization on 256 random blocks with d = 1, min = 0 and with d = 0, min = 1."""
    fmt = BLOCK_FORMATS[type_name]
    blocks = np.random.default_rng(0).integers(0, 256, size=(256, fmt.block_bytes), dtype=np.uint8)

    def values(d: float, minimum: float) -> torch.Tensor:
        b = blocks.copy()
        _set_f16(b, fmt, _SCALES, d)
        _set_f16(b, fmt, _MINS, minimum)
        return dequantize(torch.from_numpy(b), type_name, fmt.block_size * 256).double()

    base, mins = values(1.0, 0.0), values(0.0, 1.0)
    ratio = -base.mean().item() / mins.mean().item() if mins.abs().sum() > 0 else 0.0
    std = (base + ratio * mins).std().item()
    return 1 / std, ratio / std


def _random_bytes(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray | torch.Tensor:
    """Uniform random bytes, drawn on the GPU where there is one (a CUDA tensor): numpy draws ~0.35 GB/s (CI's CPU)
    and sets the scales at ~0.5 GB/s, minutes for a 70B-class file (the same seed gives other bytes on a GPU)."""
    if not torch.cuda.is_available():
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    generator = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 62)))
    return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=generator)


def random_blocks(type_name: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] weight of this type as its GGUF bytes (F32/F16/BF16 as their own dtype): mean 0, std `std`."""
    if type_name in DENSE_TYPES:
        values = (std * rng.standard_normal(size=(rows, cols), dtype=np.float32))
        if type_name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16) if type_name == "F16" else values
    fmt = BLOCK_FORMATS[type_name]
    d, minimum = _calibration(type_name)
    raw = _random_bytes((rows, fmt.row_bytes(cols)), rng)
    blocks = raw.reshape(-1, fmt.block_bytes)
    _set_f16(blocks, fmt, _SCALES, d * std)
    _set_f16(blocks, fmt, _MINS, minimum * std)
    return raw.cpu().numpy() if isinstance(raw, torch.Tensor) else raw


def random_block_weight(type_name: str, rows: int, cols: int, std: float, generator: torch.Generator):
    """random_blocks as a GGUFWeight drawn on the generator's device (load_format="dummy" experts)."""
    fmt = BLOCK_FORMATS[type_name]
    d, minimum = _calibration(type_name)
    raw = torch.randint(0, 256, (rows, fmt.row_bytes(cols)), dtype=torch.uint8, device=generator.device,
                        generator=generator)
    blocks = raw.view(-1, fmt.block_bytes)
    _set_f16(blocks, fmt, _SCALES, d * std)
    _set_f16(blocks, fmt, _MINS, minimum * std)
    return GGUFWeight.from_blocks(raw, type_name, (rows, cols))
