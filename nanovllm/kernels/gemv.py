"""y = x W^T (+ b) for up to 64 rows of x (decode at small batch), where reading W is the whole cost.
Each program owns BLOCK_N output columns and streams their rows of W once, pipelined; the x rows ride
along padded to BLOCK_M = 16, 32 or 64 (one row of x on the H100 goes to the CUDA kernel of gemv_one_row where it
fits). Reference: F.linear."""
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release

MAX_ROWS = 64
# the linears' GEMV up to this many rows, cuBLAS above: at 17-64 rows it beat cuBLAS at every Qwen3-0.6B shape on
# the H100 (cuBLAS tiles leave most SMs idle on a 1024-wide output), +3-13% decode at 24-64 sequences
def _gemv_rows(value: str) -> int:
    """NANOVLLM_GEMV_ROWS: 0 (cuBLAS only) to MAX_ROWS."""
    if not value.isdigit() or int(value) > MAX_ROWS:
        raise ValueError(f"NANOVLLM_GEMV_ROWS must be an integer from 0 to {MAX_ROWS}, got {value!r}")
    return int(value)


GEMV_ROWS = _gemv_rows(os.environ.get("NANOVLLM_GEMV_ROWS", str(MAX_ROWS)))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    wait_then_release(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)  # int8 / fp8 W: exact in x's dtype
    if HAS_SCALE:
        acc *= tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & col_ok[None, :])


def launch_config(n: int, k: int, block_m: int = 16) -> dict:
    """Tile sizes that did best for each layer shape of Qwen3-0.6B and Llama-3-8B on the H100
    (a one-off sweep, scripts/gemv_sweep.py, in git history at 248c748; 32-64 rows: .scratch sweep of Qwen3-0.6B's
    shapes): narrow column blocks for narrow outputs, long K tiles for long rows; with 32-64 rows of x, whose tiles
    share the pipeline's shared memory, shorter K tiles and, for wide outputs, as many columns as rows."""
    if block_m == 16:
        block_k = 128 if k <= 1024 else 512
        return dict(block_n=16 if n <= 2048 else 32, block_k=block_k, num_stages=6 if block_k == 128 else 4,
                    num_warps=4)
    if n <= 2048:
        return dict(block_n=16, block_k=256 if block_m == 32 else 128, num_stages=5, num_warps=4)
    if block_m == 32:
        return dict(block_n=32, block_k=256, num_stages=3, num_warps=4)
    return dict(block_n=64, block_k=128, num_stages=5 if n <= 8192 else 3, num_warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         scale: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """x: [M <= MAX_ROWS, K], weight: [N, K] (rows contiguous) -> [M, N]. launch: block_n, block_k,
    num_stages, num_warps (default: launch_config). out: [M, N] to write into (rows contiguous), else a new
    tensor. scale: fp32 [N], each output column's factor (an int8 or fp8 weight's per-channel scale)."""
    M, K = x.shape[0], weight.shape[1]
    assert M <= MAX_ROWS and x.shape[1] == K and x.stride(1) == 1 and weight.stride(1) == 1
    N = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(M))
    if not launch:
        launch = launch_config(N, K, block_m)
        if block_m > 16 and x.element_size() > 2:  # fp32 tiles are twice the shared memory: a shallower pipeline
            launch["num_stages"] = 2
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(N, launch["block_n"]),)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, y, M, N, K,
        x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        BLOCK_M=block_m, BLOCK_N=launch["block_n"], BLOCK_K=launch["block_k"],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], **pdl_launch(x.device))
    return y


gemv_reference = F.linear
