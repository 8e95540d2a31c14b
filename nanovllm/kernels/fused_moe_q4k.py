"""The fused MoE kernels (kernels/fused_moe.py) over experts kept in a GGUF file's Q4_K blocks: the same sorted pairs,
one grouped launch for gate_up (SiLU-and-mul fused) and one for down, with each weight tile dequantized in registers
from the blocks' fields (quant.gguf_weight.GGUFWeight of every expert's rows, [experts x rows, cols]). A step of 64
weights of a row reads the 32 quant bytes that hold them (byte i: weight i in its low nibble, 32 + i in its high
one) and the two sub-blocks' 6-bit scale and min of its super-block of 256. The twin: the dequantized experts through
layers/fused_moe.moe_per_expert."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_moe import align_pairs, moe_block_m, store_tile, tile_pairs
from nanovllm.kernels.gguf_gemv import BlockWeight


@triton.jit
def _sub_block_scale(scales, j):
    """The 6-bit scale and min of sub-block j (0-7, the same for every row) from each row's 12 scale bytes at
    `scales` [BLOCK_N]: the first four in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins), the last four in the
    nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    low = j < 4
    a = tl.load(scales + tl.where(low, j, j + 4))
    b = tl.load(scales + tl.where(low, j + 4, j - 4))
    c = tl.load(scales + tl.where(low, j + 4, j))
    scale = tl.where(low, a & 63, (a & 15) | ((b >> 6) << 4))
    minimum = tl.where(low, c & 63, (a >> 4) | ((c >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _q4k_tiles(qs_ptr, scales_ptr, d_ptr, dmin_ptr, rows, row_ok, stride_qs, stride_scales, stride_d, k, dtype):
    """The weights k..k+31 and k+32..k+63 of each row (k a multiple of 64), dequantized: two [BLOCK_N, 32] tiles."""
    block, chunk = k // 256, (k % 256) // 64
    half = tl.arange(0, 32)
    q = tl.load(qs_ptr + rows[:, None] * stride_qs + block * 128 + chunk * 32 + half[None, :], mask=row_ok[:, None],
                other=0)
    d = tl.load(d_ptr + rows * stride_d + block, mask=row_ok, other=0.0).to(tl.float32)
    dmin = tl.load(dmin_ptr + rows * stride_d + block, mask=row_ok, other=0.0).to(tl.float32)
    scales = scales_ptr + rows * stride_scales + block * 12
    sc_lo, mn_lo = _sub_block_scale(scales, 2 * chunk)
    sc_hi, mn_hi = _sub_block_scale(scales, 2 * chunk + 1)
    w_lo = (d * sc_lo)[:, None] * (q & 15).to(tl.float32) - (dmin * mn_lo)[:, None]
    w_hi = (d * sc_hi)[:, None] * (q >> 4).to(tl.float32) - (dmin * mn_hi)[:, None]
    return w_lo.to(dtype), w_hi.to(dtype)


@triton.jit
def _moe_q4k_kernel(a_ptr, qs_ptr, sc_ptr, d_ptr, dmin_ptr, up_qs_ptr, up_sc_ptr, up_d_ptr, up_dmin_ptr, out_ptr,
                    route_w_ptr, sorted_ids_ptr, tile_experts_ptr, rows_used_ptr, N, K, num_pairs, stride_am,
                    stride_om, stride_qs, stride_sc, stride_d, A_ROW_DIVISOR: tl.constexpr, GATED: tl.constexpr,
                    WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair, n] = A[pair // A_ROW_DIVISOR] . W[expert, n] for one tile of BLOCK_M sorted pairs and BLOCK_N
    outputs, W in Q4_K; GATED: silu(gate) * up (the up projection's own blocks); WEIGHTED: times the routing
    weight."""
    if tl.program_id(0) * BLOCK_M >= tl.load(rows_used_ptr):
        return
    pairs, pair_ok, a_rows, expert, cols, col_ok = tile_pairs(sorted_ids_ptr, tile_experts_ptr, num_pairs, N,
                                                              A_ROW_DIVISOR, BLOCK_M, BLOCK_N)
    rows = expert * N + tl.where(col_ok, cols, 0).to(tl.int64)  # the expert's weight rows
    dtype = a_ptr.dtype.element_ty
    half = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, 64):
        a_lo = tl.load(a_ptr + a_rows[:, None] * stride_am + k + half[None, :], mask=pair_ok[:, None], other=0.0)
        a_hi = tl.load(a_ptr + a_rows[:, None] * stride_am + k + 32 + half[None, :], mask=pair_ok[:, None], other=0.0)
        w_lo, w_hi = _q4k_tiles(qs_ptr, sc_ptr, d_ptr, dmin_ptr, rows, col_ok, stride_qs, stride_sc, stride_d, k,
                                dtype)
        acc = tl.dot(a_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(a_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
        if GATED:
            u_lo, u_hi = _q4k_tiles(up_qs_ptr, up_sc_ptr, up_d_ptr, up_dmin_ptr, rows, col_ok, stride_qs, stride_sc,
                                    stride_d, k, dtype)
            acc_up = tl.dot(a_lo, tl.trans(u_lo), acc_up, input_precision=PRECISION)
            acc_up = tl.dot(a_hi, tl.trans(u_hi), acc_up, input_precision=PRECISION)
    store_tile(acc, acc_up, out_ptr, route_w_ptr, pairs, pair_ok, cols, col_ok, stride_om, GATED, WEIGHTED)


def _launch(a, weight: BlockWeight, up: BlockWeight | None, out, route_weights, aligned, num_pairs: int,
            row_divisor: int, block_m: int, block_n: int = 64, num_warps: int = 4):
    sorted_ids, tile_experts, rows_used = aligned
    n = out.shape[1]
    f, u = weight.fields, (up or weight).fields
    assert weight.type_name == "Q4_K" and (up is None or up.type_name == "Q4_K")
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _moe_q4k_kernel[grid](a, f["qs"], f["scales"], f["d"], f["dmin"], u["qs"], u["scales"], u["d"], u["dmin"], out,
                          route_weights, sorted_ids, tile_experts, rows_used, n, a.shape[1], num_pairs, a.stride(0),
                          out.stride(0), f["qs"].stride(0), f["scales"].stride(0), f["d"].stride(0),
                          A_ROW_DIVISOR=row_divisor, GATED=up is not None, WEIGHTED=route_weights is not None,
                          BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                          num_warps=num_warps)


def fused_moe_q4k(x: torch.Tensor, gate: BlockWeight, up: BlockWeight, down: BlockWeight, weights: torch.Tensor,
                  ids: torch.Tensor, num_experts: int, leaves_out: bool = False) -> torch.Tensor:
    """x [T, H]; gate, up [E x I, H] and down [E x H, I] in Q4_K; weights, ids [T, k] -> [T, H] (leaves_out: ids of
    -1 are pairs left out)."""
    num_tokens, top_k = ids.shape
    num_pairs, inter, hidden = ids.numel(), down.shape[1], x.shape[1]
    block_m = moe_block_m(num_pairs)
    aligned = align_pairs(ids.contiguous(), num_experts, block_m)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _launch(x, gate, up, act, None, aligned, num_pairs, top_k, block_m)
    out = (torch.zeros if leaves_out else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(act, down, None, out, weights.flatten().contiguous(), aligned, num_pairs, 1, block_m)
    return out.view(num_tokens, top_k, hidden).sum(1)
