"""Attention over a context in parts (KV blocks streamed from host memory slot by slot, kvcache/offload_engine.py):
each part gives its output and the log-sum-exp of its scores, and the parts merge exactly into the attention over the
whole context. Plain torch, fp32: the twin of fused kernels to come."""
import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       mask: torch.Tensor | None = None):
    """q [Lq, H, D] against k, v [Lk, Hk, D] (Hk divides H); mask [Lq, Lk]: which keys each query sees (None: all;
    each query must see one at least) -> (out [Lq, H, D], lse [Lq, H]), both fp32."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), values)
    return out, lse.transpose(0, 1)


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """The attention over the union of two parts' keys from each part's (out [Lq, H, D], lse [Lq, H])."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse
