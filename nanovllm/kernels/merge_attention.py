"""Attention parts merged by their log-sum-exp in one kernel: the fused twin of attention/merge.merge_parts, for
the offloaded attention's parts (kvcache/offload_engine.py), which the torch twin merges in about ten eager ops a
layer. Every (row, head) weighs each part's output by exp(its lse - the max) and normalizes."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release


@triton.jit
def _merge_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, num_parts, part_stride_out, part_stride_lse, stride_ot,
                  stride_oh, num_heads, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, LSE: tl.constexpr,
                  PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    at = row * num_heads + head
    m = tl.load(lses_ptr + at)
    for p in range(1, num_parts):
        m = tl.maximum(m, tl.load(lses_ptr + p * part_stride_lse + at))
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    total = 0.0
    for p in range(num_parts):
        weight = tl.exp(tl.load(lses_ptr + p * part_stride_lse + at) - m)
        acc += weight * tl.load(outs_ptr + p * part_stride_out + at * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0)
        total += weight
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)
    if LSE:
        tl.store(lse_ptr + at, m + tl.log(total))


def merge_parts_fused(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None = None):
    """outs [parts, Lq, H, D] and lses [parts, Lq, H] (fp32, contiguous) -> out [Lq, H, D] (any float dtype, rows
    may be strided) and lse [Lq, H] (fp32) where given: merge_parts' result, written in place."""
    parts, rows, heads, head_dim = outs.shape
    if not (outs.is_contiguous() and lses.is_contiguous() and out.stride(2) == 1):
        raise ValueError("merge_parts_fused: outs and lses contiguous, out's head_dim contiguous")
    _merge_kernel[(rows, heads)](
        outs, lses, out, lses if lse is None else lse, parts, rows * heads * head_dim, rows * heads, out.stride(0),
        out.stride(1), heads, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), LSE=lse is not None,
        **pdl_launch(out.device))
    return out
