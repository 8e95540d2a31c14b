"""Paged attention in Triton over a KV cache of [num_blocks, block_size, kv_heads, head_dim].

- decode: one query token per sequence, split-K over the context (flash-decoding) so that few long
  sequences still fill the GPU; a second kernel merges the splits' partial softmax states.
- prefill: variable-length causal attention of each sequence's new tokens, which may follow a cached
  prefix; every key (prefix and new) is read from the cache, where store_kv has just written the new ones.
References: attention.torch_backend.decode_reference / prefill_reference.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_inputs import prefill_tile_tokens
from nanovllm.kernels.pdl import pdl_launch, wait_then_release


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, n, end, kv_head, d, d_ok,
                  stride_bt, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """K and V of context positions n .. n + BLOCK_N of one sequence and kv head, looked up page by page."""
    offs = n + tl.arange(0, BLOCK_N)
    valid = offs < end
    page = tl.load(block_tables_ptr + seq * stride_bt + offs // PAGE, mask=valid, other=0).to(tl.int64)
    base = page * stride_cb + (offs % PAGE) * stride_cs + kv_head * stride_ch
    k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=valid[:, None] & d_ok, other=0.0)
    v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=valid[:, None] & d_ok, other=0.0)
    return offs, valid, k, v


@triton.jit
def _online_softmax_step(q, k, v, allowed, m, denom, acc, scale, PRECISION: tl.constexpr, MASK: tl.constexpr = True):
    """Fold one tile of keys into the running max, denominator and weighted sum (flash attention). MASK=False: every
    key of the tile is allowed (`allowed` unused)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    if MASK:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, denom, acc


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                         acc_ptr, m_ptr, denom_ptr, out_ptr, k_new_ptr, v_new_ptr, slot_ptr, scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                         stride_knt, stride_vnt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         STORE_NEW: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                         HEADS_FIRST: tl.constexpr):
    """With STORE_NEW, the step's own key and value (k_new, v_new: [B, kv_heads, D] rows) are not in the cache yet:
    the tiles stop before the last position, and the program whose split holds it folds it in from k_new / v_new
    and writes them to the cache at the sequence's slot, which spares a store kernel (no other program reads
    that slot). The tile loop stays as without it, so large batches pay nothing for the fusion. (Rotary applied
    here as well, before the tiles, cost 3-9% of the kernel at bench.py's batches on the H100, and bench.py ran
    0.7% faster with the rotary kernel before this one.)
    HEADS_FIRST: the grid is (kv heads, sequences, splits), so the programs of one sequence's kv heads, which read
    interleaved 256-byte pieces of the same cache rows, start together."""
    wait_then_release(PDL)
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < GROUP) & (d[None, :] < HEAD_DIM), other=0.0)
    last = seq_len - 1
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    d_ok = d[None, :] < HEAD_DIM
    cached_end = tl.minimum(end, last) if STORE_NEW else end  # the new token's slot is not written yet
    for n in range(start, cached_end, BLOCK_N):
        offs, valid, k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, n, cached_end, kv_head, d,
                                          d_ok, stride_bt, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N)
        m, denom, acc = _online_softmax_step(q, k, v, valid[None, :], m, denom, acc, scale, PRECISION)
    if STORE_NEW:
        if (start <= last) & (last < end):  # this split holds the new token: fold it in from the inputs, store it
            k_new = tl.load(k_new_ptr + seq * stride_knt + kv_head * HEAD_DIM + d[None, :], mask=d_ok, other=0.0)
            v_new = tl.load(v_new_ptr + seq * stride_vnt + kv_head * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale
            m_new = tl.maximum(m, s_new)
            p_new = tl.exp(s_new - m_new)
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + p_new
            acc = acc * alpha[:, None] + p_new.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
            slot = tl.load(slot_ptr + seq).to(tl.int64)
            at = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + kv_head * stride_ch + d
            tl.store(k_cache_ptr + at[None, :], k_new, mask=d_ok)
            tl.store(v_cache_ptr + at, v_new, mask=d < HEAD_DIM)
    row_ok = g < GROUP
    if NUM_SPLITS == 1:  # the whole context in one program: normalize here, no merge kernel
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok)
        return
    part = (seq * tl.num_programs(0 if HEADS_FIRST else 1) * GROUP + heads) * NUM_SPLITS + split
    tl.store(m_ptr + part, m, mask=row_ok)
    tl.store(denom_ptr + part, denom, mask=row_ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok)


@triton.jit
def _decode_merge_kernel(acc_ptr, m_ptr, denom_ptr, out_ptr, lse_ptr, stride_ot, stride_oh, num_heads,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, LSE: tl.constexpr,
                         PDL: tl.constexpr):
    """The splits' partial softmax states merged into out; with LSE also the log-sum-exp of all the scores, to merge
    with attention over other keys (kvcache/offload_engine.py)."""
    wait_then_release(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(m_ptr + part)
    denom = tl.load(denom_ptr + part)
    m_max = tl.max(m, 0)
    weight = tl.where(denom > 0, tl.exp(m - m_max), 0.0)  # empty splits (m = -inf) weigh nothing
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM, other=0.0)
    total = tl.sum(denom * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    if LSE:
        tl.store(lse_ptr + seq * num_heads + head, m_max + tl.log(total))


def _precision(q: torch.Tensor) -> str:
    """fp32 dots in true fp32 (Triton's default for fp32 is tf32, which would break fp32 fidelity)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


DECODE_BLOCK_N = 64
# kv-head-major grids up to this many splits: the kernel alone at bench.py's batches on the H100 (contexts of its
# workload; measured while the kernel still applied rotary itself) took 0.6-5% less time at 25-214 sequences (1-2
# splits), 4% more at 7 (8)
HEADS_FIRST_MAX_SPLITS = 2


def decode_num_splits(num_seqs: int, num_kv_heads: int, context_bound: int, num_sms: int) -> int:
    """Splits of each (sequence, kv head)'s context: enough programs for about two per SM (four cost 5-7% more
    at 24-48 sequences of 700-2048 tokens on the H100: more partials to merge), but no split shorter than one
    tile of the step's context bound (attention.backend.decode_context_bound). It depends on num_seqs only
    through its next power of two, which a CUDA-graph bucket shares with every batch it serves: eager and graph
    steps split alike."""
    programs = triton.next_power_of_2(num_seqs) * num_kv_heads
    wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    return max(1, min(wanted, triton.next_power_of_2(triton.cdiv(context_bound, DECODE_BLOCK_N))))


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out=None,
                 block_n=None, num_warps=4, num_stages=None, new_kv=None, lse=None):
    """q: [B, H, D] -> [B, H, D]. num_splits is fixed by the caller (a CUDA graph bakes the grid in).
    lse: [B, H] fp32 to fill with each row's log-sum-exp of its scores (then at least two splits run).
    new_kv: (k, v, slot_mapping) of this step's tokens, [B, kv_heads, D] each (strided rows of a fused qkv are
    fine), when they are not in the cache yet: the kernel attends to them and stores them (no store_kv).
    One split (large batches) reads 128-key tiles 3 stages deep: 2% faster than 64-key tiles at 256 sequences
    on the H100 (a one-off sweep, `scripts/attention_sweep.py 256 2048 configs 1`, in git history at 248c748), where
    this kernel is most of the step."""
    if lse is not None:
        num_splits = max(num_splits, 2)  # the merge kernel gives the log-sum-exp
    if block_n is None:
        block_n, num_stages = (128, num_stages or 3) if num_splits == 1 else (DECODE_BLOCK_N, num_stages)
    B, H, D = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = H // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    # one split normalizes and writes `out` itself: no partials, so the workspace pointers go unused
    acc, m, denom = decode_workspace(B, H, D, num_splits, q.device) if num_splits > 1 else (out, out, out)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, seq_lens)
    assert new_kv is None or (k_new.stride(2) == 1 and k_new.stride(1) == D and v_new.stride(1) == D)
    heads_first = num_splits <= HEADS_FIRST_MAX_SPLITS
    grid = (num_kv_heads, B, num_splits) if heads_first else (B, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, acc, m, denom, out, k_new, v_new, slots, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), k_new.stride(0), v_new.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, D_PAD=triton.next_power_of_2(D),
        PAGE=page, BLOCK_N=block_n, NUM_SPLITS=num_splits, STORE_NEW=new_kv is not None, PRECISION=_precision(q),
        HEADS_FIRST=heads_first,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **pdl_launch(q.device))
    if num_splits > 1:
        _decode_merge_kernel[(B, H)](acc, m, denom, out, m if lse is None else lse, out.stride(0), out.stride(1), H,
                                     HEAD_DIM=D, D_PAD=triton.next_power_of_2(D), NUM_SPLITS=num_splits,
                                     LSE=lse is not None, **pdl_launch(q.device))
    return out


def decode_workspace(num_seqs, num_heads, head_dim, num_splits, device):
    n = num_seqs * num_heads * num_splits
    return (torch.empty(n * head_dim, dtype=torch.float32, device=device),
            torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device))


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr,
                    query_start_ptr, tiles_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb,
                    stride_cs, stride_ch, stride_bt, stride_tiles, num_heads, GROUP: tl.constexpr,
                    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
                    TILE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, LSE: tl.constexpr,
                    PDL: tl.constexpr):
    """One program: TILE_TOKENS query tokens of one sequence x the GROUP query heads of one KV head, as the rows
    of one tile (token-major), so each key and value is read once for the whole group. Key tiles wholly before the
    query tile's first position need no causal mask: only the tiles from there on are masked (on the H100 1.08x
    faster at bench.py's prefill step, 1.12x at 8 x 4096 tokens of Llama-3-8B, with the same results; base-2
    exponentials on top gained 1.16x more but moved the bf16 agreement with HF, so they are not used). LSE: each
    row's log-sum-exp of its scores is stored too ([T, H], kvcache/offload_engine.py)."""
    wait_then_release(PDL)
    seq = tl.load(tiles_ptr + tl.program_id(0))
    if seq < 0:
        return
    tile = tl.load(tiles_ptr + stride_tiles + tl.program_id(0))
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    r = tl.arange(0, TILE_TOKENS * GROUP_PAD)
    token = tile * TILE_TOKENS + r // GROUP_PAD
    head = kv_head * GROUP + r % GROUP_PAD
    row_ok = (token < q_len) & (r % GROUP_PAD < GROUP)
    pos = prefix + token  # absolute position of each query row
    d = tl.arange(0, D_PAD)
    d_ok = d[None, :] < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok, other=0.0)
    m = tl.full([TILE_TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([TILE_TOKENS * GROUP_PAD], tl.float32)
    acc = tl.zeros([TILE_TOKENS * GROUP_PAD, D_PAD], tl.float32)
    first = prefix + tile * TILE_TOKENS  # the tile's first query position
    end = tl.minimum(seq_len, first + TILE_TOKENS)  # causal: no key past the tile's last token
    unmasked_end = (first // BLOCK_N) * BLOCK_N  # key tiles before it: every query row sees every key
    for n in range(0, unmasked_end, BLOCK_N):
        offs, valid, k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, n, unmasked_end, kv_head, d,
                                          d_ok, stride_bt, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N)
        m, denom, acc = _online_softmax_step(q, k, v, valid[None, :], m, denom, acc, scale, PRECISION, MASK=False)
    for n in range(unmasked_end, end, BLOCK_N):
        offs, valid, k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, n, end, kv_head, d, d_ok,
                                          stride_bt, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N)
        allowed = valid[None, :] & (offs[None, :] <= pos[:, None])
        m, denom, acc = _online_softmax_step(q, k, v, allowed, m, denom, acc, scale, PRECISION)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)
    if LSE:
        tl.store(lse_ptr + (q_start + token) * num_heads + head, m + tl.log(denom), mask=row_ok)


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tiles, scale, out=None, lse=None):
    """q: [T, H, D] (sequences concatenated) -> [T, H, D]; keys come from the cache. tiles: prefill_tiles(query
    lengths, prefill_tile_tokens(query heads per KV head)) on the device, -1 entries skipped. lse: [T, H] fp32 to
    fill with each row's log-sum-exp. 32-key tiles 2 stages
    deep: 108 vs 119 us (64 keys, 3 stages) for 16 x 512 new tokens of Qwen3-0.6B on the H100."""
    T, H, D = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    group = H // num_kv_heads
    _prefill_kernel[(tiles.shape[1], num_kv_heads)](
        q, k_cache, v_cache, out, out if lse is None else lse, block_tables, seq_lens, query_start_loc, tiles, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), tiles.stride(0), H, GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=D, D_PAD=triton.next_power_of_2(D), PAGE=page,
        TILE_TOKENS=prefill_tile_tokens(group), BLOCK_N=32, PRECISION=_precision(q), LSE=lse is not None,
        num_warps=4, num_stages=2, **pdl_launch(q.device))
    return out
