"""The quantized GEMV (kernels/gguf_gemv.py) against its reference, F.linear on the torch dequantization of the
same blocks: on CPU under TRITON_INTERPRET=1 at small shapes (fp32), on the GPU (gpu) at real ones in bf16."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_as_exact_as_dense, kernel_tol, random_tensor

from nanovllm.kernels.gguf_gemv import KERNEL_TYPES, gguf_dequantize, gguf_gemv
from nanovllm.quant.gguf_weight import GGUFWeight

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(40, 256, 1), (33, 768, 3), (17, 2560, 16), (70, 512, 33), (40, 256, 130)] if DEVICE == "cpu" else \
    [(40, 256, 1), (33, 768, 3), (6144, 4096, 1), (4096, 14336, 1), (1024, 4096, 16), (4096, 14336, 5),
     (1000, 4096, 40), (4096, 14336, 100), (6144, 4096, 256)]


def weight(type_name: str, n: int, k: int, seed: int = 0) -> GGUFWeight:
    raw = torch.from_numpy(random_tensor(type_name, n, k, np.random.default_rng(seed)))
    return GGUFWeight.from_blocks(raw, type_name, (n, k)).to(DEVICE)


@pytest.mark.parametrize("n,k,m", SHAPES)
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_gguf_gemv_matches_dequantized_linear(type_name, n, k, m):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = weight(type_name, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    want = F.linear(x.float(), w.dequantize().to(dtype).float())  # the dense path: weights in the model dtype
    got = gguf_gemv(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want, **kernel_tol(dtype))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # a CUDA graph's static output
    assert gguf_gemv(x, w, out=out) is out and torch.equal(out, got)


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_weight_fields_are_the_file_blocks(type_name):
    raw = torch.from_numpy(random_tensor(type_name, 5, 512, np.random.default_rng(2)))
    w = GGUFWeight.from_blocks(raw, type_name, (5, 512))
    assert torch.equal(w.to_blocks(), raw) and w.nbytes == raw.numel()


@pytest.mark.parametrize("n,k", [(40, 512), (33, 768)] + ([(6144, 4096)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_gguf_dequantize_is_the_torch_twin(type_name, n, k):
    w = weight(type_name, n, k)
    torch.testing.assert_close(gguf_dequantize(w, torch.float32), w.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(40, 256), (6144, 4096), (4096, 14336), (1000, 2816)])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_cuda_one_row_gemv_matches_dequantized_linear(type_name, n, k):
    from nanovllm.kernels import gguf_gemv_one_row

    if k % 256 and type_name == "Q4_K":
        pytest.skip("Q4_K rows are whole super-blocks of 256")
    w = weight(type_name, n, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    assert gguf_gemv_one_row.serves(x, w)
    assert_as_exact_as_dense(gguf_gemv_one_row.gguf_gemv_one_row(x, w), x, w.dequantize().to(DEVICE))
