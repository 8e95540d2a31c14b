"""y = x W^T (+ b) for up to 64 rows of x (decode at small batch), where reading W is the whole cost.
Each program owns BLOCK_N output columns and streams their rows of W once, pipelined; the x rows ride
along padded to BLOCK_M = 16, 32 or 64 (or, with row_kernel, one row of x on the CUDA cores; bs=1 decode was
slower with it on the H100, so it is off). With l2_prefetch (experimental, NANOVLLM_GEMV_L2_PREFETCH=1; bs=1 decode within its
run-to-run spread, so off), each program first asks L2 for its rows of W, before the PDL wait. Reference:
F.linear."""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.activation import silu_mul as silu_mul_values
from nanovllm.kernels.l2_prefetch import prefetch_rows_l2
from nanovllm.kernels.pdl import pdl_launch, wait_then_release
from nanovllm.kernels.rounding import round_to
from nanovllm.logger import log_once

MAX_ROWS = 64
# the linears' GEMV up to this many rows, cuBLAS above: at 17-64 rows it beat cuBLAS at every Qwen3-0.6B shape on
# the H100 (cuBLAS tiles leave most SMs idle on a 1024-wide output), +3-13% decode at 24-64 sequences
def _gemv_rows(value: str) -> int:
    """NANOVLLM_GEMV_ROWS: 0 (cuBLAS only) to MAX_ROWS."""
    if not value.isdigit() or int(value) > MAX_ROWS:
        raise ValueError(f"NANOVLLM_GEMV_ROWS must be an integer from 0 to {MAX_ROWS}, got {value!r}")
    return int(value)


GEMV_ROWS = _gemv_rows(os.environ.get("NANOVLLM_GEMV_ROWS", str(MAX_ROWS)))
L2_PREFETCH = os.environ.get("NANOVLLM_GEMV_L2_PREFETCH", "0") == "1"
ROW_KERNEL = os.environ.get("NANOVLLM_GEMV_ROW", "0") == "1"


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, L2_PIECES: tl.constexpr, PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    # W is read-only: its rows may start toward L2 while the kernel before is still running
    prefetch_rows_l2(w_ptr + tl.where(col_ok, cols, 0).to(tl.int64) * stride_wn, K, L2_PIECES, PDL)
    wait_then_release(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & col_ok[None, :])


@triton.jit
def _row_input(x_ptr, res_ptr, norm_w_ptr, ks, k_ok, K, inv_rms, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr):
    """A chunk of the row kernel's x, with the operation fused in front of the product applied as the twin
    layers round it: SiLU-and-mul of the stacked [gate | up] projection, or RMSNorm after the residual add."""
    x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
    if SILU_MUL:
        x = silu_mul_values(x, tl.load(x_ptr + K + ks, mask=k_ok, other=0.0))
    if ADD_NORM:
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
        w_norm = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = (round_to(x.to(tl.float32) * inv_rms, x.dtype) * w_norm).to(x.dtype)
    return x


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, norm_w_ptr, res_out_ptr, N, K, stride_wn, eps,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, L2_PIECES: tl.constexpr, PDL: tl.constexpr):
    """One row of x, multiplied and summed on the CUDA cores instead of padded to an MMA tile, so that a program
    may own as few as one output column: N = 1024 outputs make 128-1024 programs instead of 64. One kernel fewer
    a layer each, every program redoing the cheap part for its own one-row x:
    SILU_MUL: x is the stacked [gate | up] projection (2K long), used as silu(gate) * up (the down projection);
    ADD_NORM: x is RMSNorm(x + residual) with weight norm_w (the projections after a norm); program 0 writes the
    sum, the next residual, to res_out."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    prefetch_rows_l2(w_ptr + tl.where(col_ok, cols, 0).to(tl.int64) * stride_wn, K, L2_PIECES, PDL)
    wait_then_release(PDL)
    inv_rms = 1.0
    if ADD_NORM:
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(res_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
                if tl.program_id(0) == 0:
                    tl.store(res_out_ptr + ks, x, mask=k_ok)
            squares += x.to(tl.float32) * x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    y = tl.zeros([BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):  # a long BLOCK_K puts many loads in flight: these loads are not pipelined
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = _row_input(x_ptr, res_ptr, norm_w_ptr, ks, k_ok, K, inv_rms, SILU_MUL, ADD_NORM, HAS_RESIDUAL)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        y += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


def launch_config(n: int, k: int, block_m: int = 16) -> dict:
    """Tile sizes that did best for each layer shape of Qwen3-0.6B and Llama-3-8B on the H100
    (scripts/gemv_sweep.py; 32-64 rows: .scratch sweep of Qwen3-0.6B's shapes): narrow column blocks for narrow
    outputs, long K tiles for long rows; with 32-64 rows of x, whose tiles share the pipeline's shared memory,
    shorter K tiles and, for wide outputs, as many columns as rows."""
    if block_m == 16:
        block_k = 128 if k <= 1024 else 512
        return dict(block_n=16 if n <= 2048 else 32, block_k=block_k, num_stages=6 if block_k == 128 else 4,
                    num_warps=4)
    if n <= 2048:
        return dict(block_n=16, block_k=256 if block_m == 32 else 128, num_stages=5, num_warps=4)
    if block_m == 32:
        return dict(block_n=32, block_k=256, num_stages=3, num_warps=4)
    return dict(block_n=64, block_k=128, num_stages=5 if n <= 8192 else 3, num_warps=4)


def row_kernel_fuses(rows: int) -> bool:
    """Whether the row kernel, which fuses SiLU-and-mul or add+RMSNorm into the product, serves this many rows:
    one, when it is on."""
    return rows == 1 and ROW_KERNEL


def _l2_pieces(weight: torch.Tensor, block_n: int, num_warps: int) -> int:
    """Bulk prefetch requests per row of W: one per thread in all; 0 where the rows are not 16-byte aligned
    pieces."""
    pieces = max(1, 32 * num_warps // block_n)
    row_bytes = weight.shape[1] * weight.element_size()
    aligned = weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0
    if aligned and row_bytes % (16 * pieces) == 0:
        return pieces
    log_once(f"GEMV L2 prefetch: a weight of {row_bytes}-byte rows does not split into 16-byte aligned pieces; "
             "its GEMVs run without the prefetch")
    return 0


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, l2_prefetch: bool = L2_PREFETCH,
         row_kernel: bool | None = None, silu_mul: bool = False, out: torch.Tensor | None = None,
         **launch) -> torch.Tensor:
    """x: [M <= MAX_ROWS, K], weight: [N, K] (rows contiguous) -> [M, N]. launch: block_n, block_k,
    num_stages, num_warps (default: launch_config). row_kernel: one row of x goes to the CUDA-core kernel
    (default: ROW_KERNEL, experimental, NANOVLLM_GEMV_ROW=1; scripts/gemv_sweep.py row times it). silu_mul (row
    kernel only): x is [1, 2K] of stacked gate and up, and the product runs on silu(gate) * up. out: [M, N] to
    write into (rows contiguous), else a new tensor."""
    M, K = x.shape[0], weight.shape[1]
    row_kernel = (ROW_KERNEL if row_kernel is None else row_kernel) and M == 1
    assert M <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
    assert x.shape[1] == (2 * K if silu_mul else K) and (row_kernel or not silu_mul)
    if row_kernel:
        return _row_gemv(x, weight, bias, l2_prefetch, silu_mul=silu_mul, out=out, **launch)
    N = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    if not launch:
        launch = launch_config(N, K, block_m)
        if block_m > 16 and x.element_size() > 2:  # fp32 tiles are twice the shared memory: a shallower pipeline
            launch["num_stages"] = 2
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(N, launch["block_n"]),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        L2_PIECES=_l2_pieces(weight, launch["block_n"], launch["num_warps"]) if l2_prefetch else 0,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl_launch(x.device))
    return y


def gemv_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, l2_prefetch: bool = L2_PREFETCH,
                      **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (RMSNorm(x + residual) W^T (+ b), x + residual) in the row kernel; without a residual, the norm
    of x and x itself. Twin: layers.layernorm.RMSNorm, then F.linear."""
    assert x.shape[0] == 1 and x.stride(1) == 1 and (residual is None or residual.is_contiguous())
    res_out = torch.empty_like(x) if residual is not None else x
    y = _row_gemv(x, weight, bias, l2_prefetch, norm=(residual, norm_weight, eps, res_out), **launch)
    return y, res_out


def _row_gemv(x, weight, bias, l2_prefetch, silu_mul=False, norm=None, out=None, **launch):
    N, K = weight.shape
    launch = launch or dict(block_n=8, block_k=1024, num_stages=1, num_warps=4)
    residual, norm_weight, eps, res_out = norm if norm is not None else (None, None, 0.0, None)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_row_kernel[(triton.cdiv(N, launch["block_n"]),)](
        x, weight, bias if bias is not None else weight, y, residual if residual is not None else x,
        norm_weight if norm is not None else weight, res_out if res_out is not None else y, N, K, weight.stride(0), eps,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
        L2_PIECES=_l2_pieces(weight, launch["block_n"], launch["num_warps"]) if l2_prefetch else 0,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl_launch(x.device))
    return y


gemv_reference = F.linear
