"""Attention over a context in parts (KV blocks streamed from host memory slot by slot, kvcache/offload_engine.py):
each part gives its output and the log-sum-exp of its scores, and the parts merge exactly into the attention over the
whole context. Plain torch, fp32: merge_parts is the twin of kernels/merge_attention.py."""
import torch

SCORES_BYTES = 256 << 20  # the fp32 scores of one chunk of queries: long contexts go a few hundred queries at a time


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None):
    """q [Lq, H, D] against k, v [Lk, Hk, D] (Hk divides H); mask [Lq, Lk]: which keys each query sees (None: all;
    each query must see one at least) -> (out [Lq, H, D], lse [Lq, H]), both fp32."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    rows = max(1, SCORES_BYTES // (4 * q.shape[1] * max(1, k.shape[0])))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[0], rows):
        scores = torch.einsum("qhd,khd->hqk", q[start:start + rows].float(), keys) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask[None, start:start + rows], float("-inf"))
        chunk_lse = torch.logsumexp(scores, dim=-1)
        out[start:start + rows] = torch.einsum("hqk,khd->qhd", torch.exp(scores - chunk_lse[..., None]), values)
        lse[start:start + rows] = chunk_lse.transpose(0, 1)
    return out, lse


def fused_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """attention_with_lse without a mask by torch's fused CUDA kernels: flash attention in fp16 / bf16, the
    memory-efficient one in fp32."""
    group = q.shape[1] // k.shape[1]
    query = q.transpose(0, 1)[None]
    keys, values = (x.transpose(0, 1).repeat_interleave(group, dim=0)[None] for x in (k, v))
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, keys, values, None, True,
                                                                           scale=scale)[:2]
    return out[0].transpose(0, 1).float(), lse[0, :, :q.shape[0]].transpose(0, 1)


def merge_parts(outs: torch.Tensor, lses: torch.Tensor):
    """The attention over the union of the parts' keys from each part's (out, lse): outs [parts, Lq, H, D], lses
    [parts, Lq, H]."""
    lse = torch.logsumexp(lses, dim=0)
    return (outs * torch.exp(lses - lse)[..., None]).sum(dim=0), lse
