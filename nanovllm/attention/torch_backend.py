"""Plain torch paged attention: the reference twin of every fast backend, and the CPU path."""
import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import AttentionMetadata


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping):
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _sdpa(q, k, v, scale, mask=None, causal=False):
    """q: [N, Lq, H, D], k/v: [N, Lk, Hk, D] -> [N, Lq, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    num_blocks = -(-length // cache.shape[1])
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def decode_reference(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale):
    """One query per sequence, all sequences at once. q: [B, H, D]."""
    block_size = k_cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks]
    k = k_cache[tables].flatten(1, 2)  # [B, L, Hk, D]
    v = v_cache[tables].flatten(1, 2)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    unwritten = ~mask[:, :, None, None]  # slots past each sequence's end may hold anything, NaN included
    k, v = k.masked_fill(unwritten, 0), v.masked_fill(unwritten, 0)
    return _sdpa(q[:, None], k, v, scale, mask=mask[:, None, None, :])[:, 0]


def prefill_reference(q, k, v, k_cache, v_cache, block_table, seq_len, scale):
    """Causal attention of one sequence's new tokens, after a cached prefix of seq_len - len(q) tokens."""
    q_len = q.shape[0]
    if q_len == seq_len:  # nothing cached before: the new k/v are the whole context
        return _sdpa(q[None], k[None], v[None], scale, causal=True)[0]
    keys = gather_context(k_cache, block_table, seq_len)
    values = gather_context(v_cache, block_table, seq_len)
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
    return _sdpa(q[None], keys[None], values[None], scale, mask=mask[None, None])[0]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        if k_cache is not None:
            store_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_cpu[:nd])
            out[:nd] = decode_reference(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                        max_len, scale)
        starts = meta.query_start_loc_cpu
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            table = meta.block_tables[i] if k_cache is not None else None
            out[s:e] = prefill_reference(q[s:e], k[s:e], v[s:e], k_cache, v_cache, table, meta.seq_lens_cpu[i], scale)
        return out
