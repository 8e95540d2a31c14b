from dataclasses import dataclass, field

import torch

# the engine and the KV cache build a step's prefill tiles through this module
from nanovllm.kernels.attention_inputs import prefill_tile_tokens, prefill_tiles  # noqa: F401


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
    prefill_tiles: torch.Tensor | None = None  # [2, n] int32 (kernels.attention_inputs.prefill_tiles), steps with prefills
    scratch: dict = field(default_factory=dict)  # a backend's per-step values, computed at the first layer
    offloaded: list[list[int]] | None = None  # per sequence, the host pool blocks of its leading KV (None: none)
    state_slots: list[int] | None = None  # per sequence, its linear-attention state slot (None: no such layers)
    state_slot_ids: torch.Tensor | None = None  # [B] int32: state_slots on the device (< 0: a CUDA-graph padding row)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
