"""A GGUF weight kept quantized, its blocks' fields split into one tensor each (struct of arrays): the same bytes as
the file's array of blocks, but each field of a tile of rows lies contiguous, so a kernel loads quants and scales
in wide aligned pieces instead of picking fields out of 18-, 34- or 210-byte blocks.

fields[name] is [N, K / block_size * bytes] uint8, except the f16 scales ("d", "m", "dmin"): float16
[N, K / block_size]. to_blocks() gives the file's bytes back; dequantize() is the reference twin of the kernels."""
from dataclasses import dataclass

import torch

from nanovllm.quant.gguf_formats import BLOCK_FORMATS, F16_FIELDS, dequantize_fields


@dataclass
class GGUFWeight:
    type_name: str
    shape: tuple[int, int]  # (N, K): rows of the weight, weights a row
    fields: dict[str, torch.Tensor]

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, type_name: str, shape: tuple[int, int]) -> "GGUFWeight":
        """raw: the file's bytes of a [N, K] weight, uint8 [N, row bytes] (or flat)."""
        fmt = BLOCK_FORMATS[type_name]
        n, k = shape
        blocks = raw.reshape(n, k // fmt.block_size, fmt.block_bytes)
        fields, at = {}, 0
        for name, size in fmt.fields:
            field = blocks[:, :, at:at + size].contiguous()
            fields[name] = field.view(torch.float16).reshape(n, -1) if name in F16_FIELDS else field.reshape(n, -1)
            at += size
        return cls(type_name, (n, k), fields)

    def to_blocks(self) -> torch.Tensor:
        fmt = BLOCK_FORMATS[self.type_name]
        n, k = self.shape
        parts = [self.fields[name].reshape(n, k // fmt.block_size, -1).view(torch.uint8) for name, _ in fmt.fields]
        return torch.cat(parts, dim=-1).reshape(n, -1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], bit for bit gguf.quants.dequantize of the file's bytes."""
        return dequantize_fields(self.fields, self.type_name, self.shape[1])

    def to(self, device) -> "GGUFWeight":
        return self.map_rows(lambda field: field.to(device))

    def map_rows(self, fn) -> "GGUFWeight":
        """fn applied to each field's [N, ...] rows, which keeps a row's blocks together (a row permutation, a
        gather of rows, a move)."""
        fields = {name: fn(field) for name, field in self.fields.items()}
        return GGUFWeight(self.type_name, (next(iter(fields.values())).shape[0], self.shape[1]), fields)

    def narrow(self, dim: int, start: int, length: int) -> "GGUFWeight":
        """Rows (dim 0) or the weights start..start+length of every row (dim 1: whole blocks), as torch's narrow (a
        tensor-parallel rank's part)."""
        if dim == 0:
            return self.map_rows(lambda field: field.narrow(0, start, length).contiguous())
        block = BLOCK_FORMATS[self.type_name].block_size
        if start % block or length % block:
            raise ValueError(f"a {self.type_name} weight splits within its rows only at whole blocks of {block} "
                             f"weights, not at {start}..{start + length}: choose a tensor_parallel_size that does")
        n, k = self.shape
        fields = {name: field.reshape(n, k // block, -1)[:, start // block:(start + length) // block]
                  .reshape(n, -1).contiguous() for name, field in self.fields.items()}
        return GGUFWeight(self.type_name, (n, length), fields)

    @staticmethod
    def cat(weights: list["GGUFWeight"]) -> "GGUFWeight":
        """Weights of one type and width stacked along the rows (a merged qkv or gate_up projection)."""
        first = weights[0]
        assert all(w.type_name == first.type_name and w.shape[1] == first.shape[1] for w in weights)
        fields = {name: torch.cat([w.fields[name] for w in weights]) for name in first.fields}
        return GGUFWeight(first.type_name, (sum(w.shape[0] for w in weights), first.shape[1]), fields)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())
