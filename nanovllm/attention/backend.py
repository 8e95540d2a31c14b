import torch

from nanovllm.attention.metadata import AttentionMetadata, DecodeRope


class AttentionBackend:
    """Paged attention over a KV cache of shape [num_blocks, block_size, num_kv_heads, head_dim].

    forward() first writes the new tokens' k/v into the cache at meta.slot_mapping (when a cache is
    given: the memory-profiling run has none), then attends every query to its whole context.
    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; returns [T, heads, head_dim].
    """

    name = "abstract"
    supports_cuda_graphs = False  # True: decode reads only device tensors, so a captured graph can replay it
    supports_prefill_graphs = True  # with supports_cuda_graphs: steps with prefills may replay graphs too
    rotates_decode = False  # True: forward takes `rope` on decode steps, with q and k unrotated

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
                v_cache: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                rope: DecodeRope | None = None) -> torch.Tensor:
        raise NotImplementedError


def rotate_decode(q: torch.Tensor, k: torch.Tensor, rope: DecodeRope, meta: AttentionMetadata) -> None:
    """A decode step's q and k (unrotated: the backend took `rope`) normed and rotated in place at each sequence's
    last position by the rotary kernel, for a decode kernel that does not rotate them itself."""
    from nanovllm.kernels.rotary import rotary_

    if "positions" not in meta.scratch:  # the same for every layer of this step
        meta.scratch["positions"] = meta.seq_lens - 1
    rotary_(meta.scratch["positions"], q, k, rope.cos, rope.sin, rope.q_norm_weight, rope.k_norm_weight, rope.eps)
