"""y = x W^T for a few rows of x (decode) with W a GGUF weight kept quantized (quant.gguf_weight.GGUFWeight): each
program owns BLOCK_N rows of W, reads each of their bytes once, dequantizes a tile of blocks in registers as the
torch twin does (the same f32 products, then the activations' dtype) and multiplies it on the tensor cores with x
padded to 16 rows. Reference: F.linear(x, weight.dequantize()). Q4_0, Q4_1, Q8_0, Q4_K and Q6_K so far
(KERNEL_TYPES)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.quant.gguf_weight import GGUFWeight

MAX_ROWS = 64
_BLOCK32 = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # types of 32-weight blocks, by their kernel's TYPE constexpr
_K_QUANTS = {"Q4_K": 0, "Q6_K": 1}  # types of 256-weight super-blocks, likewise
KERNEL_TYPES = (*_BLOCK32, *_K_QUANTS)


@triton.jit
def _x_tile(x_ptr, rows, row_ok, stride_xm, elements, element_ok):
    """[BLOCK_M, T] activations at these weight indices (0 where masked)."""
    return tl.load(x_ptr + rows[:, None] * stride_xm + elements[None, :], mask=row_ok[:, None] & element_ok[None, :],
                   other=0.0)


@triton.jit
def _scaled(q, d, BLOCK_N: tl.constexpr, NB: tl.constexpr, PER_BLOCK: tl.constexpr):
    """q [BLOCK_N, NB * PER_BLOCK] times each block's scale d [BLOCK_N, NB]."""
    return tl.reshape(tl.reshape(q, [BLOCK_N, NB, PER_BLOCK]) * d[:, :, None], [BLOCK_N, NB * PER_BLOCK])


@triton.jit
def _gemv_block32_kernel(x_ptr, d_ptr, m_ptr, qs_ptr, y_ptr, M, N, NUM_BLOCKS, stride_xm, stride_d, stride_qs,
                         stride_ym, TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         NB: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Q4_0 (TYPE 0: d * (q - 8)), Q4_1 (1: d * q + m), Q8_0 (2: d * q, q int8). NB blocks of 32 weights a step.
    Q4_0 / Q4_1 hold weight j of a block in the low nibble of quant byte j, weight j + 16 in its high nibble."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols64 = tl.where(col_ok, cols, 0).to(tl.int64)  # columns past N read row 0 and are not stored
    QB: tl.constexpr = 32 if TYPE == 2 else 16  # quant bytes a block
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
            w = _scaled(qs.to(tl.int8, bitcast=True).to(tl.float32), d, BLOCK_N, NB, 32)
            x = _x_tile(x_ptr, rows, row_ok, stride_xm, b0 * 32 + t, t_ok)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        else:
            low, high = (qs & 15).to(tl.float32), (qs >> 4).to(tl.float32)
            if TYPE == 0:
                low, high = _scaled(low - 8, d, BLOCK_N, NB, 16), _scaled(high - 8, d, BLOCK_N, NB, 16)
            else:
                m = tl.load(m_ptr + cols64[:, None] * stride_d + blk[None, :], mask=d_mask, other=0.0).to(tl.float32)
                m_t = tl.reshape(tl.broadcast_to(m[:, :, None], [BLOCK_N, NB, 16]), [BLOCK_N, NB * 16])
                low, high = _scaled(low, d, BLOCK_N, NB, 16) + m_t, _scaled(high, d, BLOCK_N, NB, 16) + m_t
            first = b0 * 32 + (t // 16) * 32 + t % 16  # the weight index of each byte's low nibble
            x_low = _x_tile(x_ptr, rows, row_ok, stride_xm, first, t_ok)
            x_high = _x_tile(x_ptr, rows, row_ok, stride_xm, first + 16, t_ok)
            acc = tl.dot(x_low, tl.trans(low.to(x_low.dtype)), acc, input_precision=PRECISION)
            acc = tl.dot(x_high, tl.trans(high.to(x_high.dtype)), acc, input_precision=PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


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
def _gemv_k_quant_kernel(x_ptr, d_ptr, dmin_ptr, scales_ptr, q_ptr, qh_ptr, y_ptr, M, N, NUM_BLOCKS, stride_xm,
                         stride_d, stride_scales, stride_q, stride_qh, stride_ym, TYPE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, PRECISION: tl.constexpr,
                         PDL: tl.constexpr):
    """Q4_K (TYPE 0: d * scale * q - dmin * min, 8 sub-blocks of 32) and Q6_K (1: d * scale * (q - 32), 16
    sub-blocks of 16), NB super-blocks of 256 weights a step, each weight's quant bits gathered in weight order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols64 = tl.where(col_ok, cols, 0).to(tl.int64)  # columns past N read row 0 and are not stored
    wait_then_release(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    e = tl.arange(0, NB * 256)  # weight of the tile
    sb = e // 256
    r = e % 256  # weight within its super-block
    for b0 in range(0, NUM_BLOCKS, NB):
        blk = b0 + tl.arange(0, NB)
        mask = col_ok[:, None] & (blk < NUM_BLOCKS)[None, :]
        blk = tl.where(blk < NUM_BLOCKS, blk, 0)  # masked super-blocks read block 0 and multiply zeros
        d = tl.load(d_ptr + cols64[:, None] * stride_d + blk[None, :], mask=mask, other=0.0).to(tl.float32)
        rows_q = q_ptr + cols64[:, None] * stride_q + ((b0 + sb) % NUM_BLOCKS)[None, :] * 128
        if TYPE == 0:
            dmin = tl.load(dmin_ptr + cols64[:, None] * stride_d + blk[None, :], mask=mask, other=0.0).to(tl.float32)
            scale, minimum = _q4_k_scales(scales_ptr + cols64[:, None] * stride_scales + blk[None, :] * 12,
                                          tl.arange(0, 8))
            byte = tl.load(rows_q + ((r // 64) * 32 + r % 32)[None, :])
            q = ((byte >> (((r // 32) % 2) * 4)[None, :]) & 15).to(tl.float32)
            step = tl.reshape(tl.broadcast_to((d[:, :, None] * scale)[:, :, :, None], [BLOCK_N, NB, 8, 32]),
                              [BLOCK_N, NB * 256])
            offset = tl.reshape(tl.broadcast_to((dmin[:, :, None] * minimum)[:, :, :, None], [BLOCK_N, NB, 8, 32]),
                                [BLOCK_N, NB * 256])
            w = step * q - offset
        else:
            scale = tl.load(scales_ptr + cols64[:, None, None] * stride_scales + blk[None, :, None] * 16
                            + tl.arange(0, 16)[None, None, :]).to(tl.int8, bitcast=True).to(tl.float32)
            low = tl.load(rows_q + ((r // 128) * 64 + r % 64)[None, :])
            high = tl.load(qh_ptr + cols64[:, None] * stride_qh + ((b0 + sb) % NUM_BLOCKS)[None, :] * 64
                           + ((r // 128) * 32 + r % 32)[None, :])
            q = ((low >> (((r % 128) // 64) * 4)[None, :]) & 15) | (((high >> (((r % 128) // 32) * 2)[None, :]) & 3) << 4)
            step = tl.reshape(tl.broadcast_to((d[:, :, None] * scale)[:, :, :, None], [BLOCK_N, NB, 16, 16]),
                              [BLOCK_N, NB * 256])
            w = step * (q.to(tl.int32) - 32).to(tl.float32)
        w = tl.where(tl.reshape(tl.broadcast_to(mask[:, :, None], [BLOCK_N, NB, 256]), [BLOCK_N, NB * 256]), w, 0.0)
        x = _x_tile(x_ptr, rows, row_ok, stride_xm, b0 * 256 + e, b0 + sb < NUM_BLOCKS)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def gguf_gemv(x: torch.Tensor, weight: GGUFWeight, out: torch.Tensor | None = None, block_n: int = 16,
              blocks: int = 8, num_warps: int = 4) -> torch.Tensor:
    """x: [M <= MAX_ROWS, K] (rows contiguous) -> [M, N] in x's dtype. out: [M, N] to write into, else a new tensor."""
    n, k = weight.shape
    m = x.shape[0]
    assert weight.type_name in KERNEL_TYPES, f"no kernel for {weight.type_name} (kernels: {', '.join(KERNEL_TYPES)})"
    assert m <= MAX_ROWS and x.shape[1] == k and x.stride(1) == 1
    f = weight.fields
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    common = dict(BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps, **pdl_launch(x.device))
    grid = (triton.cdiv(n, block_n),)
    if weight.type_name in _BLOCK32:
        _gemv_block32_kernel[grid](
            x, f["d"], f.get("m", f["d"]), f["qs"], y, m, n, k // 32, x.stride(0), f["d"].stride(0), f["qs"].stride(0),
            y.stride(0), TYPE=_BLOCK32[weight.type_name], NB=blocks, **common)
    else:
        q, qh = (f["qs"], f["qs"]) if weight.type_name == "Q4_K" else (f["ql"], f["qh"])
        _gemv_k_quant_kernel[grid](
            x, f["d"], f.get("dmin", f["d"]), f["scales"], q, qh, y, m, n, k // 256, x.stride(0), f["d"].stride(0),
            f["scales"].stride(0), q.stride(0), qh.stride(0), y.stride(0), TYPE=_K_QUANTS[weight.type_name],
            NB=max(1, blocks // 8), **common)
    return y
