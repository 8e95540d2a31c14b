import torch
from torch import nn

from nanovllm.attention import AttentionBackend, AttentionMetadata
from nanovllm.kernels.attention_inputs import DecodeRope
from nanovllm.kvcache.spec import PagedAttentionSpec


class Attention(nn.Module):
    """One layer's paged attention: holds a handle to its KV cache, delegates the math to the backend."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.backend: AttentionBackend | None = None  # set by the ModelRunner
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.layer_index = 0
        self.offload_engine = None  # with a host pool: attends to KV blocks offloaded there

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> PagedAttentionSpec:
        return PagedAttentionSpec(block_size, self.num_kv_heads, self.head_dim, dtype)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                rope: DecodeRope | None = None) -> torch.Tensor:
        """rope (only where rotates_in_kernel): q and k are unrotated, the backend rotates them."""
        if meta.offloaded is not None and self.k_cache is not None:
            return self.offload_engine.forward(self.layer_index, q, k, v, self.k_cache, self.v_cache, meta,
                                               self.scale)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, rope)

    def rotates_in_kernel(self, meta: AttentionMetadata) -> bool:
        """Whether this step's attention backend applies rotary itself: decode steps on a backend that does."""
        return (self.k_cache is not None and self.backend.rotates_decode and meta.num_decodes == meta.num_seqs
                and meta.offloaded is None)
