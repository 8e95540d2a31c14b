"""Write new tokens' K/V into the paged cache at their slots. Reference: attention.torch_backend.store_kv_reference."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """k, v: [T, kv_heads, head_dim] (rows may be strided views of a fused qkv); caches [blocks, bs, kv_heads, hd]."""
    num_tokens = slot_mapping.shape[0]
    row = k.shape[1] * k.shape[2]
    assert k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, BLOCK=triton.next_power_of_2(row), **pdl_launch(k.device))
