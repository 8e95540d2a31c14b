"""What the attention kernels take besides q, k, v and the KV cache, in plain torch and numpy (no Triton: the CPU
path builds it too): a prefill step's grid of query tiles (kernels.paged_attention.paged_prefill) and a decode step's
rope (kernels.paged_decode_cluster norms and rotates q and k itself; other backends hand it to kernels.rotary)."""
from typing import NamedTuple

import numpy as np
import torch


class DecodeRope(NamedTuple):
    """What an attention kernel needs to apply rotary (after Qwen3's q/k norms) itself on a decode step: the
    cos/sin tables [max_position, head_dim] in the model dtype, the norms' weights (None: no norms) and eps."""
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float


def prefill_tile_tokens(group: int) -> int:
    """Query tokens a prefill program takes. Its tile is those tokens x the group of query heads that share a KV
    head (padded to a power of two), 64 rows. One size for every step, so that one compiled kernel and one set of
    CUDA graphs serve short prompt chunks too (the kernel is bound by reading K/V there, not by its masked rows)."""
    return max(1, 64 // (1 << (group - 1).bit_length()))


def prefill_tiles(query_lens, tile_tokens: int) -> np.ndarray:
    """[2, n] int32: for each program of the prefill grid, its sequence and that sequence's query tile. The
    grid is one flat list of tiles rather than sequences x longest query, so that it depends on no host value
    but its length: a CUDA graph captures it with room to spare, the spare entries -1. Last tiles first: a
    prompt's later tiles read the most keys, and the GPU starts the longest programs before the short ones."""
    counts = -(-np.asarray(query_lens, dtype=np.int64) // tile_tokens)
    seq = np.repeat(np.arange(len(counts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.ascontiguousarray(np.stack([seq, np.arange(len(seq)) - first])[:, ::-1]).astype(np.int32)
