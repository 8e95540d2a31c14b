"""One-row GEMV (bs=1 decode) in CUDA C++: csrc/gemv_one_row.cu, whose header says why. Built with nvcc at
first use into a cache folder (NANOVLLM_CACHE, default ~/.cache/nanovllm) and called through ctypes; CUDA graphs
capture its launches like any other. Hopper and newer (bulk async copies); NANOVLLM_GEMV_CUDA=0 turns it off.
Twins: F.linear after layers.layernorm.rms_norm (with the residual add) or layers.activation.SiluAndMul."""
import ctypes

import torch

from nanovllm.kernels import cuda_library, pdl

# a CTA's shared memory at most: its slice of W plus the staged input row (at most 50 KB for Qwen3-0.6B's layers:
# gate_up's, two CTAs a SM), so that a GEMV's CTAs leave room on the SM for the kernels beside them. Weights past it
# (Llama-3-8B's) take the Triton GEMV.
SMEM_LIMIT = 74 * 1024
# add_norm_silu: add_norm in front, and behind, silu(gate) * up of a stacked [gate; up] weight (N / 2 outputs)
MODES = {"plain": 0, "add_norm": 1, "silu_mul": 2, "add_norm_silu": 3}
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
# CTAs of one GEMV per SM: CTAS_PER_SM, and MLP_CTAS_PER_SM for the MLP's two (a stacked [gate; up] weight, or rows
# longer than 2048, as down_proj's of Qwen3-0.6B: fewer copies of its 6 KB input row staged a SM). bs=1 decode of
# Qwen3-0.6B on the H100, the weight streamed a chunk at a time, (qkv, o, gate_up, down): 3, 3, 3, 3: 1,438-1,449
# tok/s; 3, 3, 2, 2: 1,465-1,466; 3, 3, 2, 3: 1,453-1,454; 3, 3, 3, 2: 1,425-1,431; 2, 3, 2, 2: 1,459; 4, 3, 2, 2:
# 1,454; 3, 2, 2, 2: 1,394; 3, 3, 1, 2: 1,348 (all at 2: 1,415-1,420, all at 4: 1,435-1,437).
# The same two GEMVs let the next kernel launch only after their PDL wait (kLaunchNextLate in the .cu).
CTAS_PER_SM = 3
MLP_CTAS_PER_SM = 2
MAX_K = 4096  # kMaxK of the .cu: each thread holds its share of the staged input row in registers

def why_off(device: torch.device) -> str | None:
    """None when the kernel runs on this device, else why not (said once in the log: the Triton GEMV runs)."""
    return cuda_library.entry_point(
        "gemv_one_row", device, "NANOVLLM_GEMV_CUDA",
        [ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int] * 3 + [ctypes.c_float] + [ctypes.c_int] * 2
        + [ctypes.c_void_p],
        "one-row GEMVs (bs=1 decode) run the CUDA kernel of csrc/gemv_one_row.cu",
        "one-row GEMVs run the Triton GEMV: the CUDA one is off ({reason})")


def _library() -> ctypes.CDLL:
    return cuda_library.library("gemv_one_row")


def ctas_per_sm(weight: torch.Tensor, parts: int = 1) -> int:
    return MLP_CTAS_PER_SM if parts == 2 or weight.shape[1] > 2048 else CTAS_PER_SM


def rows_per_cta(weight: torch.Tensor, parts: int = 1) -> int:
    """Outputs each CTA owns (ctas_per_sm CTAs per SM): rows of W, or of each of its `parts` stacked halves."""
    sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
    return -(-weight.shape[0] // parts // (sms * ctas_per_sm(weight, parts)))


def smem_bytes(weight: torch.Tensor, parts: int = 1) -> int:
    """The CTA's slice of W and the input row."""
    return (parts * rows_per_cta(weight, parts) + 1) * weight.shape[1] * weight.element_size()


def fits(weight: torch.Tensor, silu_out: bool = False) -> bool:
    """Whether this weight can take the kernel: a 16-byte aligned [N, K] bf16/fp16 matrix, K a multiple of 8 up to
    MAX_K, whose per-CTA slice fits the shared memory budget, on a device where the kernel runs. silu_out: as the
    stacked [gate; up] weight of mode add_norm_silu (N even)."""
    parts = 2 if silu_out else 1
    return (weight.dtype in _DTYPES and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] % 8 == 0
            and weight.shape[1] <= MAX_K and weight.shape[0] % parts == 0 and weight.data_ptr() % 16 == 0
            and why_off(weight.device) is None and smem_bytes(weight, parts) <= SMEM_LIMIT)


def gemv_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, mode: str = "plain",
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: one contiguous row ([1, K]; [1, 2K] of stacked gate and up for silu_mul); weight: [N, K] that fits().
    Returns (y [1, N] ([1, N / 2] for add_norm_silu), the next residual): add_norm(_silu) gives x + residual (x
    itself without a residual), other modes None. out: y's tensor to write into."""
    n, k = weight.shape
    parts = 2 if mode == "add_norm_silu" else 1
    assert fits(weight, parts == 2) and x.is_contiguous() and x.dtype == weight.dtype
    assert x.numel() == (2 * k if mode == "silu_mul" else k)
    y = torch.empty(1, n // parts, dtype=x.dtype, device=x.device) if out is None else out
    res_out = None
    if mode.startswith("add_norm"):
        res_out = torch.empty_like(x) if residual is not None else x
    ptr = cuda_library.pointer
    error = _library().nanovllm_gemv_one_row(
        _DTYPES[x.dtype], x.data_ptr(), weight.data_ptr(), ptr(bias), y.data_ptr(), ptr(residual), ptr(norm_weight),
        ptr(res_out if residual is not None else None), n, k, rows_per_cta(weight, parts), eps, MODES[mode],
        int(pdl.why_off(x.device) is None), cuda_library.stream_of(x))
    cuda_library.check(_library(), error, "gemv_one_row")
    return y, res_out
