from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step's batch, as every attention backend sees it.

    B sequences, decodes (exactly one new token) first, then prefills (chunks of a prompt, which may
    follow a cached prefix); T new tokens in all.
    """

    slot_mapping: torch.Tensor     # [T] int64: KV-cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens of the new tokens
    seq_lens: torch.Tensor         # [B] int32: context length after this step (cached prefix + new tokens)
    block_tables: torch.Tensor     # [B, max_blocks] int32: KV blocks of each sequence, 0-padded
    num_decodes: int               # the first num_decodes sequences have one new token each
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int] | None  # host copies, for backends that loop over sequences (None in a
    seq_lens_cpu: list[int] | None         # captured CUDA graph, whose backend reads only device tensors)
    prefill_tiles: torch.Tensor | None = None  # [2, n] int32 (kernels.paged_attention.prefill_tiles), steps with prefills
    scratch: dict = field(default_factory=dict)  # a backend's per-step values, computed at the first layer
    offloaded: list[list[int]] | None = None  # per sequence, the host pool blocks of its leading KV (None: none)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


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
