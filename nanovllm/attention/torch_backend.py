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


def context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, block_size: int):
    """[B, max_len] cache slot of every context position, and its validity mask. Positions past a sequence's
    end point at its first slot, which is always written, so the gather never reads garbage such as NaN."""
    pos = torch.arange(max_len, device=block_tables.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    valid = pos[None, :] < seq_lens[:, None]
    return torch.where(valid, slots, slots[:, :1]), valid


def decode_reference(q, k_cache, v_cache, slots, valid, scale):
    """One new token per sequence, all sequences in one masked attention. q: [B, H, D] -> [B, H, D]."""
    B, H, D = q.shape
    flat = slots.flatten()  # index_select is several times faster than advanced indexing on CPU
    keys = k_cache.flatten(0, 1).index_select(0, flat).view(B, slots.shape[1], -1, D).transpose(1, 2)
    values = v_cache.flatten(0, 1).index_select(0, flat).view(B, slots.shape[1], -1, D).transpose(1, 2)
    grouped = q.view(B, keys.shape[1], H // keys.shape[1], D)  # a kv head's query heads act as its queries
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(B, H, D)


def prefill_reference(q, k, v, k_cache, v_cache, block_table, seq_len, scale):
    """Causal attention of one sequence's new tokens (q: [n, H, D]), which follow seq_len - n cached ones."""
    q_len = q.shape[0]
    if k_cache is None or q_len == seq_len:  # nothing cached before: the new k/v are the whole context
        return _sdpa(q[None], k[None], v[None], scale, causal=True)[0]
    keys = gather_context(k_cache, block_table, seq_len)
    values = gather_context(v_cache, block_table, seq_len)
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
    return _sdpa(q[None], keys[None], values[None], scale, mask=mask[None, None])[0]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, rope=None):
        if k_cache is not None:
            store_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes if k_cache is not None else 0
        if nd:
            if "decode_slots" not in meta.scratch:  # the same for every layer of this step
                meta.scratch["decode_slots"] = context_slots(meta.block_tables[:nd], meta.seq_lens[:nd],
                                                             max(meta.seq_lens_cpu[:nd]), k_cache.shape[1])
            out[:nd] = decode_reference(q[:nd], k_cache, v_cache, *meta.scratch["decode_slots"], scale)
        starts = meta.query_start_loc_cpu
        for i in range(nd, meta.num_seqs):  # prefills sequence by sequence: exact lengths, nothing padded
            s, e = starts[i], starts[i + 1]
            out[s:e] = prefill_reference(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[i],
                                         meta.seq_lens_cpu[i], scale)
        return out
