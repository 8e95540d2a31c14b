import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.attention_inputs import DecodeRope


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
    cuda_decode = False  # True: decode steps of few sequences may take kernels.paged_decode_cluster (on self.device)

    def decode_context_bounds(self, num_seqs: int, max_model_len: int) -> list[int]:
        """The context-length bounds (ascending, the last max_model_len) at which a decode step of num_seqs sequences
        may take another kernel plan: decode graphs are captured per bound, and every decode step, eager or
        replayed, is planned for the smallest bound that holds its longest context (decode_context_bound)."""
        if not self.cuda_decode:
            return [max_model_len]
        from nanovllm.kernels import paged_decode_cluster

        return paged_decode_cluster.context_bounds(num_seqs, max_model_len, self.device)

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


def decode_context_bound(backend: AttentionBackend, meta: AttentionMetadata, max_model_len: int) -> int:
    """The bound a decode step is planned for (AttentionBackend.decode_context_bounds), found once a step."""
    if "context_bound" not in meta.scratch:
        bounds = backend.decode_context_bounds(meta.num_seqs, max_model_len)
        meta.scratch["context_bound"] = next(b for b in bounds if b >= meta.max_seq_len)
    return meta.scratch["context_bound"]
