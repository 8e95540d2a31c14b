"""Fused mixture of experts: the token-expert pairs sorted by expert and padded to tiles of BLOCK_M rows (each tile
one expert's), then one grouped launch for every expert's gate_up projection with SiLU-and-mul fused (the
intermediate is written once, already activated) and one for the down projection scaled by the routing weight.
Every size is fixed by the token count, never by the routing, and nothing is read back to the host: the steps that
run it can be CUDA graphs. Reference: layers.fused_moe.moe_sorted."""
import torch
import triton
import triton.language as tl

ALIGN_IN_ONE_PROGRAM = 4096  # pairs up to which one program sorts them (decode: one launch, not a dozen small ops)


def moe_block_m(num_pairs: int) -> int:
    """Rows of a tile: few for decode (a tile per routed expert, mostly padding), more once experts get many rows."""
    return 16 if num_pairs <= 1024 else 64


def max_sorted_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The pairs padded per expert at worst: every expert that can be routed to leaves a tile part empty."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token: softmax over its experts in fp32, the top k (optionally renormalized), as route_top_k."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + token * stride + experts, mask=experts < num_experts, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    probs = e / tl.sum(e, 0)
    probs = tl.where(probs == probs, probs, 0.0)  # NaN logits (a graph's warm-up on garbage) still pick real experts
    total = 1.0
    if RENORMALIZE:
        left, total = probs, 0.0
        for _ in tl.static_range(TOP_K):
            best = tl.max(left, 0)
            total += best
            left = tl.where(experts == tl.min(tl.where(left == best, experts, BLOCK_E), 0), -1.0, left)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        chosen = tl.min(tl.where(probs == best, experts, BLOCK_E), 0)
        tl.store(weights_ptr + token * TOP_K + j, (best / total).to(weights_ptr.dtype.element_ty))
        tl.store(ids_ptr + token * TOP_K + j, chosen.to(tl.int64))
        probs = tl.where(experts == chosen, -1.0, probs)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_top_k (layers/fused_moe.py) in one launch."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    _route_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                             RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts))
    return weights, ids


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, tile_experts_ptr, rows_used_ptr, cursor_ptr, num_pairs, num_experts,
                  max_rows, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """align_pairs in one program: count each expert's pairs, pad the counts to tiles, then place each pair at its
    expert's cursor (an atomic: the order inside an expert's rows is free, each pair's output row is its own)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=BLOCK_E)
        counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_experts)
    tl.store(rows_used_ptr, tl.sum(padded, 0))
    for start in range(0, max_rows, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, num_pairs, mask=rows < max_rows)
    for start in range(0, max_rows // BLOCK_M, CHUNK):
        tiles = start + tl.arange(0, CHUNK)
        expert = tl.sum((ends[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(tile_experts_ptr + tiles, tl.minimum(expert, num_experts - 1), mask=tiles * BLOCK_M < max_rows)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ok = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=ok, other=0)
        ok = ok & (ids >= 0)  # -1: a pair left out
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=ok)
        tl.store(sorted_ptr + row, pairs, mask=ok)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert to block_m rows, padding = num_pairs; each tile's expert; rows used [1]),
    all on the device; a pair whose id is -1 is left out. Tiles past the rows used are launched and return at once (a
    size fixed by the token count)."""
    num_pairs = ids.numel()
    max_rows = max_sorted_rows(num_pairs, num_experts, block_m)
    if num_pairs <= ALIGN_IN_ONE_PROGRAM:
        sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=ids.device)
        tile_experts = torch.empty(max_rows // block_m, dtype=torch.int32, device=ids.device)
        rows_used = torch.empty(1, dtype=torch.int32, device=ids.device)
        cursor = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
        _align_kernel[(1,)](ids, sorted_ids, tile_experts, rows_used, cursor, num_pairs, num_experts, max_rows,
                            BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=64)
        return sorted_ids, tile_experts, rows_used
    return _align_pairs_torch(ids, num_experts, block_m, max_rows)


def _align_pairs_torch(ids: torch.Tensor, num_experts: int, block_m: int, max_rows: int):
    """align_pairs for many pairs (prefill), in torch ops that keep everything on the device."""
    num_pairs = ids.numel()
    flat = torch.where(ids.flatten() < 0, num_experts, ids.flatten())  # a pair left out: the bucket past the last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, flat,
                                                                                           torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[-1:].zero_()  # no host scalar: the torch path runs inside CUDA graph captures too
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=ids.device)
    place = torch.where(sorted_experts < num_experts, (ends - padded)[sorted_experts] + rank, max_rows)
    sorted_ids[place] = order.to(torch.int32)  # the pairs left out land in the extra row, cut off below
    sorted_ids = sorted_ids[:max_rows]
    ends = ends[:num_experts]
    tile_starts = torch.arange(0, max_rows, block_m, device=ids.device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, tile_experts, ends[-1:].to(torch.int32)


@triton.jit
def tile_pairs(sorted_ids_ptr, tile_experts_ptr, num_pairs, N, A_ROW_DIVISOR: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """This program's tile: (its BLOCK_M sorted pairs, which are real, their rows of A, the tile's expert, its BLOCK_N
    output columns, which are real)."""
    tile = tl.program_id(0)
    pairs = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (pairs, pairs < num_pairs, (pairs // A_ROW_DIVISOR).to(tl.int64),
            tl.load(tile_experts_ptr + tile).to(tl.int64), cols, cols < N)


@triton.jit
def store_tile(acc, acc_up, out_ptr, route_w_ptr, pairs, pair_ok, cols, col_ok, stride_om, GATED: tl.constexpr,
               WEIGHTED: tl.constexpr):
    """GATED: silu(acc) * acc_up, rounded where SiluAndMul's torch path rounds (the projections, then silu, then the
    product); WEIGHTED: times each pair's routing weight; stored at the pairs' rows."""
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    if WEIGHTED:
        acc = acc.to(dtype).to(tl.float32) * tl.load(route_w_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(dtype),
             mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, route_w_ptr, sorted_ids_ptr, tile_experts_ptr, rows_used_ptr,
                     N, K, num_pairs, stride_am, stride_we, stride_wn, stride_om, up_offset,
                     A_ROW_DIVISOR: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair, n] = A[pair // A_ROW_DIVISOR] . W[expert, n] for one tile of BLOCK_M sorted pairs and BLOCK_N
    outputs; GATED: silu(gate) * up, the up rows up_offset below the gate rows; WEIGHTED: times the pair's routing
    weight."""
    if tl.program_id(0) * BLOCK_M >= tl.load(rows_used_ptr):
        return
    pairs, pair_ok, a_rows, expert, cols, col_ok = tile_pairs(sorted_ids_ptr, tile_experts_ptr, num_pairs, N,
                                                              A_ROW_DIVISOR, BLOCK_M, BLOCK_N)
    w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        acc = tl.dot(a, tl.trans(tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)), acc,
                     input_precision=PRECISION)
        if GATED:
            up = tl.load(w_rows + up_offset * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(up), acc_up, input_precision=PRECISION)
    store_tile(acc, acc_up, out_ptr, route_w_ptr, pairs, pair_ok, cols, col_ok, stride_om, GATED, WEIGHTED)


def launch_config(block_m: int) -> dict:
    """The best of a sweep at Qwen3-30B-A3B's expert shape on the H200 (docs/design-notes.md)."""
    return dict(block_n=64, block_k=128 if block_m == 16 else 64, num_warps=4, num_stages=3)


def _launch(a, w, out, route_weights, aligned, num_pairs: int, n: int, row_divisor: int, gated: bool,
            block_m: int, launch: dict, up_offset: int = 0):
    sorted_ids, tile_experts, rows_used = aligned
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, launch["block_n"]))
    _moe_gemm_kernel[grid](a, w, out, route_weights, sorted_ids, tile_experts, rows_used, n, a.shape[1], num_pairs,
                           a.stride(0), w.stride(0), w.stride(1), out.stride(0), up_offset,
                           A_ROW_DIVISOR=row_divisor, GATED=gated, WEIGHTED=route_weights is not None,
                           BLOCK_M=block_m, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
                           PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=launch["num_warps"],
                           num_stages=launch["num_stages"])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              launch: dict | None = None, leaves_out: bool = False) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights, ids [T, k] -> [T, H].
    launch: block_n, block_k, num_warps, num_stages (default: launch_config). leaves_out: some ids are -1, pairs
    left out (their rows of the sum are zeros)."""
    num_tokens, top_k = ids.shape
    num_pairs, inter, hidden = ids.numel(), w2.shape[2], x.shape[1]
    block_m = moe_block_m(num_pairs)
    aligned = align_pairs(ids.contiguous(), w13.shape[0], block_m)
    launch = launch or launch_config(block_m)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, w13, act, None, aligned, num_pairs, inter, top_k, True, block_m, launch, up_offset=inter)
    out = (torch.zeros if leaves_out else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(act, w2, out, weights.flatten().contiguous(), aligned, num_pairs, hidden, 1, False, block_m, launch)
    return out.view(num_tokens, top_k, hidden).sum(1)
