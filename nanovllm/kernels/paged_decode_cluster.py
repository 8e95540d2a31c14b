"""Paged decode attention for a few sequences in CUDA C++: csrc/paged_decode_cluster.cu, whose header says why.
Each (sequence, kv head) is one thread-block cluster of splits (plan()) that copy their share of the context before
the PDL wait, norm and rotate q and k, store the step's k and v, and merge through distributed shared memory.
Hopper and newer; NANOVLLM_DECODE_CUDA=0 turns it off. Twin: attention.torch_backend.decode_reference after
RotaryEmbedding.forward_native (the Triton twin: kernels.paged_attention.paged_decode with new_kv and rope)."""
import ctypes

import torch

from nanovllm.kernels import cuda_library, pdl
from nanovllm.kernels.attention_inputs import DecodeRope
from nanovllm.logger import log_once

# splits of one (sequence, kv head), one thread-block cluster: bs=1 decode of Qwen3-0.6B on the H100 ran 1,128 /
# 1,131 tok/s with 16 (the largest cluster Hopper allows, non-portable), 1,111 / 1,112 with 8 (the portable size);
# at 2-4 sequences 8 (16 was slower there: more CTAs than SMs)
ONE_SEQ_SPLITS = 16
FEW_SEQS_SPLITS = 8
MAX_CAP = 128    # context positions a CTA holds at once: 64 KB of K and V at head_dim 128 in bf16
MAX_SEQS = 4     # decode steps of at most this many sequences take this kernel
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_GROUPS = (1, 2, 4, 8)
_HEAD_DIMS = (64, 128)

_no_16_cluster: set[str] = set()  # devices where a 16-CTA cluster did not launch: 8 there


class _Params(ctypes.Structure):
    """The kernel's Params, field by field (element strides)."""
    _fields_ = ([(name, ctypes.c_void_p) for name in ("q", "k_new", "v_new", "k_cache", "v_cache", "out",
                                                      "block_tables", "seq_lens", "slot_mapping", "cos", "sin",
                                                      "q_norm_w", "k_norm_w")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_int64) for name in ("stride_qt", "stride_qh", "stride_knt", "stride_vnt",
                                                       "stride_ot", "stride_oh", "stride_cb", "stride_cs",
                                                       "stride_ch", "stride_bt")]
                + [("page", ctypes.c_int), ("cap", ctypes.c_int)])


def why_off(device: torch.device) -> str | None:
    """None when the kernel runs on this device, else why not (said once in the log: the Triton decode runs)."""
    return cuda_library.entry_point(
        "paged_decode_cluster", device, "NANOVLLM_DECODE_CUDA",
        [ctypes.c_int, ctypes.POINTER(_Params)] + [ctypes.c_int] * 6 + [ctypes.c_void_p],
        f"decode steps of up to {MAX_SEQS} sequence(s) run the CUDA attention of csrc/paged_decode_cluster.cu",
        "decode attention runs the Triton kernels at every batch: the CUDA one is off ({reason})")


def _library() -> ctypes.CDLL:
    return cuda_library.library("paged_decode_cluster")


def capacity(context_bound: int, splits: int) -> int:
    """Positions a CTA holds: a splits-th of the longest context (16-aligned), at most MAX_CAP."""
    share = -(-context_bound // splits)
    return min(MAX_CAP, (share + 15) // 16 * 16)


def _splits(num_seqs: int, device: torch.device) -> int:
    return ONE_SEQ_SPLITS if num_seqs == 1 and str(device) not in _no_16_cluster else FEW_SEQS_SPLITS


def context_bounds(num_seqs: int, max_model_len: int, device: torch.device) -> list[int]:
    """The context-length bounds a decode step of num_seqs sequences is planned (and captured) for: the powers of
    two from 256 up to what the clusters hold in one round (a CTA's share of the context then 16 to MAX_CAP
    positions: the smaller the share, the less shared memory beside the GEMVs that launch under it), and
    max_model_len, past which the Triton kernels run."""
    bounds = {max_model_len}
    if num_seqs <= MAX_SEQS:
        limit = min(_splits(num_seqs, device) * MAX_CAP, max_model_len)
        bounds |= {b for b in (256, 512, 1024, 2048) if b <= limit}
    return sorted(bounds)


def plan(num_seqs: int, context_bound: int, device: torch.device) -> tuple[int, int] | None:
    """(splits, capacity) of a decode step of num_seqs sequences whose contexts are at most context_bound, or None:
    the Triton kernels take it. Only where every context fits the cluster's shared memory in one round (all of it
    copied before the wait): a longer one takes rounds loaded after the wait, and a 3,000-token bs=1 decode took 31
    us a layer that way on the H100, 20 with the Triton kernels."""
    splits = _splits(num_seqs, device)
    if num_seqs > MAX_SEQS or context_bound > splits * MAX_CAP:
        return None
    return splits, capacity(context_bound, splits)


def takes(q: torch.Tensor, k_cache: torch.Tensor, num_seqs: int) -> bool:
    """Whether a decode step of these queries [B, H, D] and this cache runs this kernel."""
    head_dim, group = q.shape[2], q.shape[1] // k_cache.shape[2]
    return (num_seqs <= MAX_SEQS and q.dtype in _DTYPES and k_cache.dtype == q.dtype and head_dim in _HEAD_DIMS
            and group in _GROUPS and q.shape[1] % k_cache.shape[2] == 0 and k_cache.is_contiguous()
            and why_off(q.device) is None)


def serves(device: torch.device) -> bool:
    """Whether decode steps of few sequences can take this kernel on this device (builds it now, not in a graph
    capture; why_off logs why not)."""
    return why_off(device) is None


def decode_step(q, k, v, k_cache, v_cache, meta, scale: float, rope: DecodeRope | None,
                context_bound: int) -> torch.Tensor | None:
    """A decode-only step's attention through this kernel where it takes the step (plan(), takes(); rope given:
    q and k unrotated), else None: the caller's kernels run it."""
    step_plan = plan(meta.num_seqs, context_bound, q.device)
    if step_plan is None or rope is None or not takes(q, k_cache, meta.num_seqs):
        return None
    return paged_decode_cluster(q, k, v, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.slot_mapping, scale,
                                rope, *step_plan)


def paged_decode_cluster(q, k_new, v_new, k_cache, v_cache, block_tables, seq_lens, slot_mapping, scale: float,
                         rope: DecodeRope, splits: int, cap: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D], k_new / v_new: [B, kv_heads, D] this step's unrotated queries and keys and its values (strided
    rows of a fused qkv are fine; each head row contiguous) -> [B, H, D]. The kernel norms (when rope has norm
    weights) and rotates q and k at position seq_len - 1, stores k and v at slot_mapping, and attends over the
    whole context. splits (8 or 16), cap: plan()'s (a CUDA graph bakes them in)."""
    B, H, D = q.shape
    _, page, kv_heads, _ = k_cache.shape
    assert takes(q, k_cache, B) and rope.cos.is_contiguous() and rope.cos.shape[1] == D
    assert page & (page - 1) == 0, f"the kernel takes power-of-two pages (shifts), got {page}"
    assert q.stride(2) == 1 and k_new.stride(1) == D and k_new.stride(2) == 1 and v_new.stride(1) == D
    assert v_new.stride(2) == 1 and slot_mapping.dtype == torch.int64 and block_tables.dtype == torch.int32
    # the kernel reads head rows in 4- to 16-byte pieces
    assert all(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 for t in (q, k_new, v_new)) and q.stride(1) % 8 == 0
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device) if out is None else out
    ptr = cuda_library.pointer
    params = _Params(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                     out.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), slot_mapping.data_ptr(),
                     rope.cos.data_ptr(), rope.sin.data_ptr(), ptr(rope.q_norm_weight), ptr(rope.k_norm_weight),
                     rope.eps, scale, q.stride(0), q.stride(1), k_new.stride(0), v_new.stride(0), out.stride(0),
                     out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
                     page, cap)
    def launch(splits):
        return _library().nanovllm_paged_decode_cluster(
            _DTYPES[q.dtype], ctypes.byref(params), D, H // kv_heads, splits, kv_heads, B,
            int(pdl.why_off(q.device) is None), cuda_library.stream_of(q))

    error = launch(splits)
    if error != 0 and splits == 16 and launch(8) == 0:  # the first (eager) step finds out, before any capture
        _no_16_cluster.add(str(q.device))
        log_once(f"16-CTA clusters do not launch on {q.device}: the CUDA decode attention runs 8 splits "
                 f"({_library().nanovllm_cuda_error_string(error).decode()})")
        error = 0
    cuda_library.check(_library(), error, "paged_decode_cluster")
    return out
