"""The GPU default: Triton paged attention (split-K decode that also stores the step's K/V; KV store, then
varlen prefill over a cached prefix), and a CUDA decode kernel (kernels.paged_decode_cluster) for decode steps of
at most 4 sequences whose contexts fit its shared memory. Decode steps take q and k unrotated: the CUDA kernel
rotates them itself, and for the Triton one the rotary kernel runs first. Both are planned for the step's context
bound (decode_context_bound), not for max_model_len."""
import torch

from nanovllm.attention.backend import AttentionBackend, decode_context_bound, rotate_decode
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.kernels import num_sms, paged_decode_cluster
from nanovllm.kernels.kv_store import store_kv
from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode, paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    rotates_decode = True  # decode steps take rope: the CUDA kernel of few sequences applies it, else rotate_decode

    def __init__(self, max_model_len: int, device: torch.device):
        self.max_model_len = max_model_len
        self.device = device
        self.cuda_decode = paged_decode_cluster.serves(device)
        self._reference = TorchAttentionBackend()  # for the memory-profiling run, which has no cache

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, rope=None):
        if k_cache is None:
            return self._reference.forward(q, k, v, None, None, meta, scale)
        if meta.num_decodes == meta.num_seqs:  # the decode kernels store the step's keys and values themselves
            bound = decode_context_bound(self, meta, self.max_model_len)
            out = paged_decode_cluster.decode_step(q, k, v, k_cache, v_cache, meta, scale, rope,
                                                   bound) if self.cuda_decode else None
            if out is not None:
                return out
            if rope is not None:  # the rotary kernel first, not in the decode kernel: bench.py on the H100 ran
                rotate_decode(q, k, rope, meta)  # 20,334-20,376 tok/s this way, 20,213-20,228 rotating in it
            splits = decode_num_splits(meta.num_seqs, k_cache.shape[2], bound, num_sms(q.device))
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits,
                                new_kv=(k, v, meta.slot_mapping))
        assert rope is None, "rope is taken on decode steps only"
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                             meta.prefill_tiles, scale)
