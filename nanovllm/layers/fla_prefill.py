"""Prompts through a Gated DeltaNet layer on CUDA with fla-core (flash-linear-attention's Triton kernels): every
prompt of the step in one varlen launch of its causal conv1d and one of the chunked gated delta rule, starting from
the sequences' states and leaving theirs after. Where fla-core does not import, None, and the layer runs the plain
torch twins (layers/linear_attention.py), logged once."""
import functools

import torch
import torch.nn.functional as F

from nanovllm.logger import log_once


@functools.cache
def fla_ops():
    """(causal_conv1d, chunk_gated_delta_rule) from fla-core, or None where it does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        log_once(f"fla-core does not import ({error}): prompts run the plain torch gated delta rule, one sequence "
                 "at a time (pip install fla-core for its Triton kernels)")
        return None
    log_once("linear attention: fla-core's chunked gated delta rule for prompts, nanovllm's Triton kernels for decode")
    return causal_conv1d, chunk_gated_delta_rule


def prefill_varlen(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                   conv_states: torch.Tensor | None, ssm_states: torch.Tensor | None, cu_seqlens: list[int],
                   num_k_heads: int, head_k_dim: int, num_v_heads: int) -> tuple[torch.Tensor, tuple | None]:
    """mixed [T, conv_dim] (q, k, v side by side, before the conv) of N prompts' new tokens; g (log decay, fp32) and
    beta [T, Hv]; conv_weight [conv_dim, W]; conv_states [N, conv_dim, W-1] and ssm_states [N, Hv, dk, dv] fp32
    (None: every prompt starts from zeros and no state is kept). Returns (o [T, Hv, dv], (conv states, ssm states)
    after each prompt, or None)."""
    causal_conv1d, chunk_gated_delta_rule = fla_ops()
    tokens, keep = mixed.shape[0], conv_states is not None
    cu = torch.tensor(cu_seqlens, dtype=torch.int64)
    cu_device = cu.to(mixed.device, non_blocking=True)
    # fla's conv state holds the last W inputs; ours the last W - 1 (the oldest of fla's is never read)
    initial = F.pad(conv_states.to(mixed.dtype), (1, 0)) if keep else None
    # mixed is a column slice of in_proj's rows; fla reads contiguous rows
    mixed, conv_after = causal_conv1d(mixed.contiguous()[None], conv_weight, None, initial_state=initial,
                                      output_final_state=keep, activation="silu", cu_seqlens=cu_device,
                                      cu_seqlens_cpu=cu)
    key_dim = num_k_heads * head_k_dim
    q, k, v = mixed[0].split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], -1)
    q, k = (t.reshape(1, tokens, num_k_heads, head_k_dim) for t in (q, k))
    out, ssm_after = chunk_gated_delta_rule(
        q, k, v.reshape(1, tokens, num_v_heads, -1), g[None], beta[None], initial_state=ssm_states,
        output_final_state=keep, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_device, cu_seqlens_cpu=cu)
    return out[0], (conv_after[..., 1:], ssm_after) if keep else None
