"""One-row GEMV (bs=1 decode) over GGUF 4-bit weights kept quantized, in CUDA C++: csrc/gguf_gemv_one_row.cu, whose
header says how. fp16 activations; Q4_0, Q4_1, Q4_K and INT4_G128 (TYPES). Built with nvcc at first use and called through
ctypes, as kernels/gemv_one_row.py; NANOVLLM_GGUF_GEMV_CUDA=0 turns it off (the Triton GEMV runs instead).
Twin: F.linear(x, weight.dequantize())."""
import ctypes

import torch

from nanovllm.kernels import cuda_library, pdl
from nanovllm.kernels.gguf_gemv import BlockWeight

TYPES = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2, "INT4_G128": 3}


def why_off(device: torch.device) -> str | None:
    """None when the kernel runs on this device, else why not (said once in the log)."""
    return cuda_library.entry_point(
        "gguf_gemv_one_row", device, "NANOVLLM_GGUF_GEMV_CUDA",
        [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_void_p],
        "one-row GEMVs of Q4_0 / Q4_1 / Q4_K / INT4_G128 weights run the CUDA kernel of csrc/gguf_gemv_one_row.cu",
        "one-row GEMVs of GGUF weights run the Triton GEMV: the CUDA one is off ({reason})")


def serves(x: torch.Tensor, weight: BlockWeight) -> bool:
    return (weight.type_name in TYPES and x.dtype == torch.float16 and x.is_contiguous() and x.numel() == x.shape[-1]
            and x.data_ptr() % 16 == 0 and why_off(x.device) is None)


def gguf_gemv_one_row(x: torch.Tensor, weight: BlockWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, K] fp16 that serves() -> [1, N]; out: [1, N] (contiguous) to write into, else a new tensor."""
    n, k = weight.shape
    f = weight.fields
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    offset = f.get("m", f.get("dmin", f["d"]))
    scales = f.get("scales", f["qs"])
    library = cuda_library.library("gguf_gemv_one_row")
    error = library.nanovllm_gguf_gemv_one_row(
        TYPES[weight.type_name], x.data_ptr(), f["d"].data_ptr(), offset.data_ptr(), scales.data_ptr(),
        f["qs"].data_ptr(), y.data_ptr(), n, k, f["d"].stride(0), scales.stride(0), f["qs"].stride(0),
        int(pdl.why_off(x.device) is None), cuda_library.stream_of(x))
    cuda_library.check(library, error, "gguf_gemv_one_row")
    return y
