"""GGUF's block formats: one table (weights a block, bytes a block, the fields in block order) that the loader and
every kernel read, and a plain torch dequantization of each, the twin of every kernel: bit for bit what
`gguf.quants.dequantize` computes (the same float32 products and sums, in the same order).

A row of a quantized weight [N, K] is K / block_size blocks stored one after another, so a weight is a uint8
tensor [N, K / block_size * block_bytes] and any slice of whole rows is one too."""
from dataclasses import dataclass

import torch

QK_K = 256  # weights a K-quant super-block
DENSE_TYPES = ("F32", "F16", "BF16")  # one weight a "block": no quantization
F16_FIELDS = ("d", "m", "dmin")  # the f16 scale (d) and offset (m, dmin) fields


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_size: int  # weights a block
    block_bytes: int
    fields: tuple[tuple[str, int], ...]  # (name, bytes), in block order; f16 scales are "d", "m", "dmin"

    def offset(self, field: str) -> int:
        at = 0
        for name, size in self.fields:
            if name == field:
                return at
            at += size
        raise KeyError(field)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.block_bytes


_FORMATS = [
    BlockFormat("F32", 1, 4, (("f32", 4),)),
    BlockFormat("F16", 1, 2, (("f16", 2),)),
    BlockFormat("BF16", 1, 2, (("bf16", 2),)),
    BlockFormat("Q4_0", 32, 18, (("d", 2), ("qs", 16))),
    BlockFormat("Q4_1", 32, 20, (("d", 2), ("m", 2), ("qs", 16))),
    BlockFormat("Q5_0", 32, 22, (("d", 2), ("qh", 4), ("qs", 16))),
    BlockFormat("Q5_1", 32, 24, (("d", 2), ("m", 2), ("qh", 4), ("qs", 16))),
    BlockFormat("Q8_0", 32, 34, (("d", 2), ("qs", 32))),
    BlockFormat("Q2_K", QK_K, 84, (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2))),
    BlockFormat("Q3_K", QK_K, 110, (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2))),
    BlockFormat("Q4_K", QK_K, 144, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128))),
    BlockFormat("Q5_K", QK_K, 176, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128))),
    BlockFormat("Q6_K", QK_K, 210, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2))),
]
FORMATS = {f.name: f for f in _FORMATS}
# Not a GGUF type: quantization="int4" quantizes 16-bit checkpoints into it at load (quant/quantize.py). Q4_1's fields
# and formula (w = d * q + m: a scale and a zero offset) over groups of 128 weights; quant byte i of a group holds
# weight i in its low nibble and weight 64 + i in its high nibble. The kernels read it as they read Q4_1.
INT4_G128 = BlockFormat("INT4_G128", 128, 68, (("d", 2), ("m", 2), ("qs", 64)))
BLOCK_FORMATS = {**FORMATS, INT4_G128.name: INT4_G128}  # every format that a GGUFWeight may hold
assert all(sum(size for _, size in f.fields) == f.block_bytes for f in BLOCK_FORMATS.values())


def _fields(blocks: torch.Tensor, fmt: BlockFormat) -> dict[str, torch.Tensor]:
    """[n, block_bytes] uint8 -> each field's bytes, f16 fields as float32 [n, 1]."""
    out, at = {}, 0
    for name, size in fmt.fields:
        raw = blocks[:, at:at + size]
        out[name] = raw.contiguous().view(torch.float16).float() if name in F16_FIELDS else raw
        at += size
    return out


def _shifted(x: torch.Tensor, shifts: list[int], dim: int) -> torch.Tensor:
    """x >> shift for each shift, side by side along dim (where x has size 1): no shift tensor is copied to the
    device, which a CUDA graph capture would refuse."""
    return torch.cat([x >> shift for shift in shifts], dim)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes [n, g * group] -> [n, g, 2 * group]: each group's low nibbles, then its high nibbles."""
    qs = qs.reshape(qs.shape[0], -1, group)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(x: torch.Tensor, group: int, shifts: list[int], mask: int) -> torch.Tensor:
    """Bytes [n, g * group] -> [n, g, len(shifts) * group]: (x >> shift) & mask for each shift in turn."""
    x = _shifted(x.reshape(x.shape[0], -1, 1, group), shifts, 2)
    return (x & mask).reshape(x.shape[0], -1, len(shifts) * group)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4-byte little-endian mask [n, 4] -> bit j of it for each of the block's 32 weights [n, 32]."""
    word = qh.contiguous().view(torch.int32)
    return ((word >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1).to(torch.uint8)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (scales, mins) [n, 8] as uint8."""
    d, m, m_d = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_0(f):
    q = _nibbles(f["qs"], 16).reshape(f["qs"].shape[0], -1).to(torch.int8) - 8
    return f["d"] * q.float()


def _q4_1(f):
    q = _nibbles(f["qs"], f["qs"].shape[1]).reshape(f["qs"].shape[0], -1).float()
    return f["d"] * q + f["m"]


def _q5(f):
    low = _nibbles(f["qs"], 16).reshape(f["qs"].shape[0], -1)
    return low | (_high_bits_32(f["qh"]) << 4)


def _q5_0(f):
    return f["d"] * (_q5(f).to(torch.int8) - 16).float()


def _q5_1(f):
    return f["d"] * _q5(f).float() + f["m"]


def _q8_0(f):
    return f["qs"].contiguous().view(torch.int8).float() * f["d"]


def _q2_k(f):
    n = f["qs"].shape[0]
    dl = (f["d"] * (f["scales"] & 0xF).float()).reshape(n, 16, 1)
    ml = (f["dmin"] * (f["scales"] >> 4).float()).reshape(n, 16, 1)
    q = _bits(f["qs"], 32, [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(f):
    n = f["qs"].shape[0]
    low, high = f["scales"][:, :8], f["scales"][:, 8:]
    low = _shifted(low.reshape(n, 1, 8), [0, 4], 1).reshape(n, 16)
    high = _shifted(high.reshape(n, 1, 4), [0, 2, 4, 6], 1).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (f["d"] * scales.float()).reshape(n, 16, 1)
    ql = _bits(f["qs"], 32, [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = _bits(f["hmask"], 32, list(range(8)), 1).reshape(n, 16, 16) ^ 1  # the offset applies where the bit is 0
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _q4_k(f, high=None):
    n = f["qs"].shape[0]
    sc, mn = _k_scale_min(f["scales"])
    d = (f["d"] * sc.float()).reshape(n, -1, 1)
    dm = (f["dmin"] * mn.float()).reshape(n, -1, 1)
    q = _nibbles(f["qs"], 32).reshape(n, -1, 32)
    if high is not None:
        q = q | (high.reshape(n, -1, 32) << 4)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q5_k(f):
    return _q4_k(f, high=_bits(f["qh"], 32, list(range(8)), 1))


def _q6_k(f):
    n = f["ql"].shape[0]
    d = (f["d"] * f["scales"].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    ql = _nibbles(f["ql"], 64).reshape(n, -1, 32)
    qh = _bits(f["qh"], 32, [0, 2, 4, 6], 3).reshape(n, -1, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, -1).float()).reshape(n, QK_K)


_DEQUANTIZE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "INT4_G128": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k,
               "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, type_name: str, cols: int) -> torch.Tensor:
    """A GGUF tensor's bytes, uint8 [rows, row_bytes] (or flat), -> float32 [rows, cols]. The reference twin of
    every quantized kernel."""
    fmt = BLOCK_FORMATS.get(type_name)
    if fmt is None:
        raise ValueError(f"no torch dequantization for GGUF type {type_name}; it has: {', '.join(BLOCK_FORMATS)}")
    if cols % fmt.block_size:
        raise ValueError(f"a {type_name} row of {cols} weights is not whole blocks of {fmt.block_size}")
    raw = raw.reshape(-1, fmt.row_bytes(cols))
    rows = raw.shape[0]
    if type_name in DENSE_TYPES:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        return raw.contiguous().view(dtype).float()
    blocks = raw.reshape(-1, fmt.block_bytes)
    return _DEQUANTIZE[type_name](_fields(blocks, fmt)).reshape(rows, cols)


def dequantize_fields(fields: dict[str, torch.Tensor], type_name: str, cols: int) -> torch.Tensor:
    """dequantize() of a weight held as one tensor a field (quant.gguf_weight: bytes [rows, blocks * size], f16
    fields [rows, blocks]) without rebuilding the file's blocks: the same functions on the same values, 3-4x less
    time on CPU."""
    fmt = BLOCK_FORMATS[type_name]
    rows = next(iter(fields.values())).shape[0]
    blocks = rows * (cols // fmt.block_size)
    f = {name: fields[name].reshape(blocks, 1).float() if name in F16_FIELDS else fields[name].reshape(blocks, size)
         for name, size in fmt.fields}
    return _DEQUANTIZE[type_name](f).reshape(rows, cols)
