"""y = x W^T for up to MAX_ROWS rows of x (decode batches) with W a GGUF weight kept quantized
(quant.gguf_weight.GGUFWeight): each program owns BLOCK_N rows of W and BLOCK_M rows of x, reads each of their
weight bytes once, dequantizes a tile of blocks in registers as the torch twin does (the same f32 products, then the
activations' dtype) and multiplies it on the tensor cores with x padded to BLOCK_M rows. Reference:
F.linear(x, weight.dequantize()). Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and INT4_G128 (the int4 of quantization="int4", read
as Q4_1 in groups of 128) so far (KERNEL_TYPES); Q5_0/1 and Q6_K ran at 3-6% of HBM bandwidth in this form and are
dequantized at load instead. With DEQUANT the same kernels write the dense weight instead (gguf_dequantize), for
cuBLAS past MAX_ROWS rows. quant/gguf_linear.py picks among them and the CUDA one-row kernel (docs/benchmarks.md:
their bandwidth)."""
from typing import Protocol

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release


class BlockWeight(Protocol):
    """What the kernels read of a weight kept quantized (quant.gguf_weight.GGUFWeight): its GGUF type, (N, K), and
    its blocks' fields, one tensor a field ([N, ...] rows)."""
    type_name: str
    shape: tuple[int, int]
    fields: dict[str, torch.Tensor]


MAX_ROWS = 256  # past it, Triton dequantize + cuBLAS (the crossover above 256 rows is not measured yet)


def launch_config(m: int) -> dict:
    """Tiles by rows of x: up to 16 one MMA tile of x against 32 rows of W a program (the GEMV); more, x tiled too
    (a dequant-GEMM). The best of a sweep at Llama-3-8B's shapes on the H100 for INT4_G128 and Q4_K, 1.0-11x
    faster than dequantize + cuBLAS at 32-256 rows (docs/benchmarks.md)."""
    if m <= 16:
        return dict(block_m=16, block_n=32, blocks=16, num_warps=4)
    if m <= 32:
        return dict(block_m=32, block_n=64, blocks=4, num_warps=4)
    if m <= 64:
        return dict(block_m=64, block_n=32, blocks=8, num_warps=4)
    return dict(block_m=128, block_n=64, blocks=4, num_warps=8)
# types of one scale a block, by their kernel's TYPE constexpr and weights a block
_SMALL_BLOCKS = {"Q4_0": (0, 32), "Q4_1": (1, 32), "Q8_0": (2, 32), "INT4_G128": (1, 128)}
KERNEL_TYPES = (*_SMALL_BLOCKS, "Q4_K", "Q5_K")


@triton.jit
def _x_tile(x_ptr, rows, row_ok, stride_xm, elements, element_ok):
    """[BLOCK_M, T] activations at these weight indices (0 where masked)."""
    return tl.load(x_ptr + rows[:, None] * stride_xm + elements[None, :], mask=row_ok[:, None] & element_ok[None, :],
                   other=0.0)


@triton.jit
def _accumulate(acc, x, w, PRECISION: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x [BLOCK_M, T] @ w [BLOCK_N, T]^T on the tensor cores, w rounded to x's dtype first
    (as the dense path holds it). One row summed in registers instead ran 1.5-2x slower on the H100."""
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)


@triton.jit
def _use(acc, w, weights, ok, x_ptr, rows, row_ok, stride_xm, y_ptr, cols64, col_ok, stride_ym,
         PRECISION: tl.constexpr, DEQUANT: tl.constexpr):
    """A dequantized tile w [BLOCK_N, T] of the weights at indices `weights` (where ok): multiplied into acc, or with
    DEQUANT stored into y ([N, K], the dense weight) instead."""
    if DEQUANT:
        tl.store(y_ptr + cols64[:, None] * stride_ym + weights[None, :], w.to(y_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & ok[None, :])
        return acc
    return _accumulate(acc, _x_tile(x_ptr, rows, row_ok, stride_xm, weights, ok), w, PRECISION)


@triton.jit
def _store_rows(acc, y_ptr, rows, row_ok, cols, col_ok, stride_ym, DEQUANT: tl.constexpr):
    if not DEQUANT:
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _scaled(q, d, BLOCK_N: tl.constexpr, NB: tl.constexpr, PER_BLOCK: tl.constexpr):
    """q [BLOCK_N, NB * PER_BLOCK] times each block's scale d [BLOCK_N, NB]."""
    return tl.reshape(tl.reshape(q, [BLOCK_N, NB, PER_BLOCK]) * d[:, :, None], [BLOCK_N, NB * PER_BLOCK])


@triton.jit
def _gemv_small_blocks_kernel(x_ptr, d_ptr, m_ptr, qs_ptr, y_ptr, M, N, NUM_BLOCKS, stride_xm, stride_d, stride_qs,
                              stride_ym, TYPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, NB: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                              DEQUANT: tl.constexpr):
    """Q4_0 (TYPE 0: d * (q - 8)), Q4_1 and INT4_G128 (1: d * q + m), Q8_0 (2: d * q, q int8). NB blocks of GROUP
    weights a step. The 4-bit types hold weight j of a block in the low nibble of quant byte j, weight j + GROUP / 2
    in its high nibble."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols64 = tl.where(col_ok, cols, 0).to(tl.int64)  # columns past N read row 0 and are not stored
    QB: tl.constexpr = GROUP if TYPE == 2 else GROUP // 2  # quant bytes a block
    wait_then_release(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    t = tl.arange(0, NB * QB)  # byte of the tile
    for b0 in range(0, NUM_BLOCKS, NB):
        blk = b0 + tl.arange(0, NB)
        d_mask = col_ok[:, None] & (blk < NUM_BLOCKS)[None, :]
        d = tl.load(d_ptr + cols64[:, None] * stride_d + blk[None, :], mask=d_mask, other=0.0).to(tl.float32)
        t_ok = b0 + t // QB < NUM_BLOCKS
        qs = tl.load(qs_ptr + cols64[:, None] * stride_qs + (b0 * QB + t)[None, :], mask=col_ok[:, None] & t_ok[None, :],
                     other=0)
        if TYPE == 2:
            w = _scaled(qs.to(tl.int8, bitcast=True).to(tl.float32), d, BLOCK_N, NB, GROUP)
            acc = _use(acc, w, b0 * GROUP + t, t_ok, x_ptr, rows, row_ok, stride_xm, y_ptr, cols64, col_ok, stride_ym,
                       PRECISION, DEQUANT)
        else:
            low, high = (qs & 15).to(tl.float32), (qs >> 4).to(tl.float32)
            if TYPE == 0:
                low, high = _scaled(low - 8, d, BLOCK_N, NB, QB), _scaled(high - 8, d, BLOCK_N, NB, QB)
            else:
                m = tl.load(m_ptr + cols64[:, None] * stride_d + blk[None, :], mask=d_mask, other=0.0).to(tl.float32)
                m_t = tl.reshape(tl.broadcast_to(m[:, :, None], [BLOCK_N, NB, QB]), [BLOCK_N, NB * QB])
                low, high = _scaled(low, d, BLOCK_N, NB, QB) + m_t, _scaled(high, d, BLOCK_N, NB, QB) + m_t
            first = b0 * GROUP + (t // QB) * GROUP + t % QB  # the weight index of each byte's low nibble
            acc = _use(acc, low, first, t_ok, x_ptr, rows, row_ok, stride_xm, y_ptr, cols64, col_ok, stride_ym,
                       PRECISION, DEQUANT)
            acc = _use(acc, high, first + QB, t_ok, x_ptr, rows, row_ok, stride_xm, y_ptr, cols64, col_ok, stride_ym,
                       PRECISION, DEQUANT)
    _store_rows(acc, y_ptr, rows, row_ok, cols, col_ok, stride_ym, DEQUANT)


@triton.jit
def _q4_k_scales(s_ptr, j):
    """Q4_K's 6-bit scales and mins of sub-blocks j [J] from each super-block's 12 bytes at s_ptr [BN, NB]: the
    first four in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins), the last four in bytes 8-11's nibbles with
    their top 2 bits in the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first = (j < 4)[None, None, :]
    base = s_ptr[:, :, None]
    a = tl.load(base + tl.where(j < 4, j, j + 4)[None, None, :])
    b = tl.load(base + tl.where(j < 4, j + 4, j - 4)[None, None, :])
    c = tl.load(base + tl.where(j < 4, j + 4, j)[None, None, :])
    scale = tl.where(first, a & 63, (a & 15) | ((b >> 6) << 4))
    minimum = tl.where(first, c & 63, (a >> 4) | ((c >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _per_weight(v, BLOCK_N: tl.constexpr, NB: tl.constexpr, GROUPS: tl.constexpr, SIZE: tl.constexpr):
    """[BLOCK_N, NB, GROUPS] -> [BLOCK_N, NB * GROUPS * SIZE]: each value repeated for its SIZE weights."""
    return tl.reshape(tl.broadcast_to(v[:, :, :, None], [BLOCK_N, NB, GROUPS, SIZE]), [BLOCK_N, NB * GROUPS * SIZE])


@triton.jit
def _gemv_q4_k_kernel(x_ptr, d_ptr, dmin_ptr, scales_ptr, q_ptr, qh_ptr, y_ptr, M, N, NUM_BLOCKS, stride_xm, stride_d,
                      stride_scales, stride_q, stride_qh, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      NB: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, DEQUANT: tl.constexpr,
                      Q5: tl.constexpr):
    """Q4_K: d * scale * q - dmin * min in 8 sub-blocks of 32, NB super-blocks of 256 weights a step (_launch
    passes 1: two ran 8x slower on the H100, dequantizing at 0.3 TB/s against 2.6, and at 8-9% of HBM at 16 rows). Its
    128 quant bytes a super-block are read as one contiguous tile: byte 32c + i holds weight 64c + i in its low nibble
    and 64c + 32 + i in its high nibble. Q5 (Q5_K): their fifth bits are bits 2c and 2c + 1 of qh byte i."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols64 = tl.where(col_ok, cols, 0).to(tl.int64)  # columns past N read row 0 and are not stored
    wait_then_release(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    u = tl.arange(0, NB * 128)  # low-bits byte of the tile
    sb, v = u // 128, u % 128  # its super-block in the tile, its byte in the super-block
    first = sb * 256 + (v // 32) * 64 + v % 32  # the weight of its low nibble, in the tile
    second = first + 32
    for b0 in range(0, NUM_BLOCKS, NB):
        blk = b0 + tl.arange(0, NB)
        blk_ok = blk < NUM_BLOCKS
        mask = col_ok[:, None] & blk_ok[None, :]
        u_ok = b0 + sb < NUM_BLOCKS
        u_mask = col_ok[:, None] & u_ok[None, :]
        d = tl.load(d_ptr + cols64[:, None] * stride_d + blk[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + cols64[:, None] * stride_q + (b0 * 128 + u)[None, :], mask=u_mask, other=0)
        dmin = tl.load(dmin_ptr + cols64[:, None] * stride_d + blk[None, :], mask=mask, other=0.0).to(tl.float32)
        scale_ptr = scales_ptr + cols64[:, None] * stride_scales + tl.where(blk_ok, blk, 0)[None, :] * 12
        sub = tl.arange(0, 4) * 2  # the sub-blocks of the low nibbles; the high nibbles' are sub + 1
        sc_first, mn_first = _q4_k_scales(scale_ptr, sub)
        sc_second, mn_second = _q4_k_scales(scale_ptr, sub + 1)
        q_first, q_second = q & 15, q >> 4
        if Q5:
            qh = tl.load(qh_ptr + cols64[:, None] * stride_qh + (b0 * 32 + sb * 32 + v % 32)[None, :], mask=u_mask,
                         other=0)
            shift = (v // 32) * 2
            q_first = q_first | (((qh >> shift[None, :]) & 1) << 4)
            q_second = q_second | (((qh >> (shift + 1)[None, :]) & 1) << 4)
        w_first = (_per_weight(d[:, :, None] * sc_first, BLOCK_N, NB, 4, 32) * q_first.to(tl.float32)
                   - _per_weight(dmin[:, :, None] * mn_first, BLOCK_N, NB, 4, 32))
        w_second = (_per_weight(d[:, :, None] * sc_second, BLOCK_N, NB, 4, 32) * q_second.to(tl.float32)
                    - _per_weight(dmin[:, :, None] * mn_second, BLOCK_N, NB, 4, 32))
        acc = _use(acc, w_first, b0 * 256 + first, u_ok, x_ptr, rows, row_ok, stride_xm, y_ptr, cols64, col_ok,
                   stride_ym, PRECISION, DEQUANT)
        acc = _use(acc, w_second, b0 * 256 + second, u_ok, x_ptr, rows, row_ok, stride_xm, y_ptr, cols64, col_ok,
                   stride_ym, PRECISION, DEQUANT)
    _store_rows(acc, y_ptr, rows, row_ok, cols, col_ok, stride_ym, DEQUANT)


def gguf_gemv(x: torch.Tensor, weight: BlockWeight, out: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """x: [M, K] (rows contiguous) -> [M, N] in x's dtype. out: [M, N] to write into, else a new tensor. launch:
    block_m, block_n, blocks, num_warps (default: launch_config(M))."""
    n, k = weight.shape
    m = x.shape[0]
    assert x.shape[1] == k and x.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, weight, y, m, dequant=False, **(launch or launch_config(m)))
    return y


# (blocks, num_warps) of the dequantize kernel a type, the best of a sweep at 14336 x 4096 on the H100: 2.5-2.6 TB/s
# read and written for each
DEQUANT_LAUNCH = {"Q4_0": (16, 4), "INT4_G128": (16, 8), "Q8_0": (8, 8), "Q4_K": (8, 4)}


def gguf_dequantize(weight: BlockWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight in dtype: the same values the GEMV multiplies (its twin: weight.dequantize())."""
    w = torch.empty(weight.shape, dtype=dtype, device=weight.fields["d"].device)
    blocks, num_warps = DEQUANT_LAUNCH.get(weight.type_name, (16, 4))
    _launch(w, weight, w, 0, dequant=True, block_m=16, block_n=16, blocks=blocks, num_warps=num_warps)
    return w


def _launch(x, weight: BlockWeight, y, m: int, dequant: bool, block_m: int, block_n: int, blocks: int,
            num_warps: int):
    """The type's kernel over the weight's rows: y = x W^T, or with dequant W into y (x is then unused)."""
    n, k = weight.shape
    assert weight.type_name in KERNEL_TYPES, f"no kernel for {weight.type_name} (kernels: {', '.join(KERNEL_TYPES)})"
    f = weight.fields
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=num_warps, DEQUANT=dequant, **pdl_launch(x.device))
    grid = (triton.cdiv(n, block_n), max(1, triton.cdiv(m, block_m)))
    if weight.type_name in _SMALL_BLOCKS:
        type_id, group = _SMALL_BLOCKS[weight.type_name]
        _gemv_small_blocks_kernel[grid](
            x, f["d"], f.get("m", f["d"]), f["qs"], y, m, n, k // group, x.stride(0), f["d"].stride(0),
            f["qs"].stride(0), y.stride(0), TYPE=type_id, GROUP=group, NB=max(1, blocks * 32 // group), **common)
    else:
        qh = f.get("qh", f["d"])  # Q5_K's fifth bits
        if weight.type_name == "Q5_K":  # three stages of its 128 x 64 tile ask for 240 KB of shared memory
            common["num_stages"] = 2
        _gemv_q4_k_kernel[grid](
            x, f["d"], f["dmin"], f["scales"], f["qs"], qh, y, m, n, k // 256, x.stride(0), f["d"].stride(0),
            f["scales"].stride(0), f["qs"].stride(0), qh.stride(0), y.stride(0), NB=1, Q5=weight.type_name == "Q5_K",
            **common)
