"""flash-attn 2 (>= 2.5: paged KV) where it is importable: the step's K/V go into the cache with the Triton store
kernel, then decode steps attend through flash_attn_with_kvcache and steps with prefills through
flash_attn_varlen_func over the paged cache (cached prefixes and chunked prefill included; decodes in the same
step are one-token queries). Its paged kernels need blocks of a multiple of 256 tokens. Steps with prefills run
eagerly: the varlen call takes the step's longest query and context as host integers, which a graph would bake
in. Decode steps of at most 4 sequences run the CUDA decode kernel of the triton backend where it takes them
(kernels.paged_decode_cluster: bs=1 decode of Qwen3-0.6B on the H100 ran 801 tok/s through flash-attn, 1,096
through that kernel); decode steps therefore take q and k unrotated, and the others are rotated here first.
Reference: torch_backend."""
import torch

from nanovllm.attention.backend import AttentionBackend, decode_context_bound, rotate_decode
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.platform import FLASH_ATTN_DTYPES as DTYPES
from nanovllm.platform import FLASH_ATTN_PAGE as PAGE_MULTIPLE
from nanovllm.platform import flash_attn_available


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True
    supports_prefill_graphs = False

    def __init__(self, block_size: int, dtype: torch.dtype, max_model_len: int, device: torch.device):
        if not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs the flash_attn package (2.5 or newer), which is "
                             "not importable here; pass attention_backend=None for the default")
        if dtype not in DTYPES:
            raise ValueError(f"attention_backend='flash_attn' runs float16 and bfloat16 only, got dtype={dtype}: pass "
                             "dtype='bfloat16', or attention_backend=None for the default")
        if block_size % PAGE_MULTIPLE:
            raise ValueError(f"attention_backend='flash_attn' needs block_size a multiple of {PAGE_MULTIPLE} (its "
                             f"paged kernels), got {block_size}: pass block_size={PAGE_MULTIPLE}")
        self._reference = TorchAttentionBackend()  # for the memory-profiling run, which has no cache
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from nanovllm.kernels import paged_decode_cluster
        from nanovllm.kernels.kv_store import store_kv

        self._varlen, self._with_kvcache, self._store_kv = flash_attn_varlen_func, flash_attn_with_kvcache, store_kv
        self._cuda_decode = paged_decode_cluster.decode_step
        self.max_model_len = max_model_len
        self.device = device
        # decode steps take q and k unrotated where the CUDA kernel may take some of them
        self.cuda_decode = self.rotates_decode = paged_decode_cluster.serves(device)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, rope=None):
        if k_cache is None:
            return self._reference.forward(q, k, v, None, None, meta, scale)
        if rope is not None:  # a decode step (rotates_decode)
            bound = decode_context_bound(self, meta, self.max_model_len)
            out = self._cuda_decode(q, k, v, k_cache, v_cache, meta, scale, rope, bound)
            if out is not None:
                return out
            rotate_decode(q, k, rope, meta)
        self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.num_decodes == meta.num_seqs:
            return self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                      block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        if "cu_seqlens_k" not in meta.scratch:  # the same for every layer of this step
            cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
            torch.cumsum(meta.seq_lens, 0, out=cu_seqlens_k[1:])
            meta.scratch["cu_seqlens_k"] = cu_seqlens_k
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc,
                            cu_seqlens_k=meta.scratch["cu_seqlens_k"],
                            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len, softmax_scale=scale,
                            causal=True, block_table=meta.block_tables)
