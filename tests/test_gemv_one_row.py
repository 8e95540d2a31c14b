"""The CUDA one-row GEMV (csrc/gemv_one_row.cu) against its torch twins on the GPU; on CPU, that it stays off and
says why. tests/test_cuda_library.py builds its source."""
import pytest
import torch
import torch.nn.functional as F
from helpers import kernel_tol

from nanovllm.kernels import gemv_one_row as one_row
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm

# Qwen3-0.6B's four layer shapes, then tails: N not a multiple of the SM count, chunks of 0-1 rows, long K
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (40, 96), (333, 264), (131, 1032), (7, 4096)]


def _inputs(n, k, dtype, seed, x_len=None):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) * scale).to(dtype).cuda()
            for shape, scale in (((1, x_len or k), 1.0), ((n, k), 0.05), ((n,), 1.0))]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_matches_linear(n, k, dtype, bias):
    x, w, b = _inputs(n, k, dtype, 1)
    b = b if bias else None
    got, _ = one_row.gemv_one_row(x, w, b)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), None if b is None else b.float()),
                               **kernel_tol(dtype))
    assert torch.equal(got, one_row.gemv_one_row(x, w, b)[0])  # deterministic: fixed summation order
    out = torch.full((1, n), float("nan"), dtype=dtype, device="cuda")
    assert one_row.gemv_one_row(x, w, b, out=out)[0] is out and torch.equal(out, got)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_norm_matches_rms_norm_then_linear(n, k, dtype, with_residual):
    x, w, _ = _inputs(n, k, dtype, 2)
    residual = _inputs(n, k, dtype, 3)[0]
    norm = RMSNorm(k, 1e-6).cuda()
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(4))).to(dtype).cuda()
    if with_residual:
        normed, want_residual = norm.forward_native(x, residual)
    else:
        normed, want_residual, residual = norm.forward_native(x), x, None
    got, got_residual = one_row.gemv_one_row(x, w, None, "add_norm", residual, norm.weight, norm.eps)
    torch.testing.assert_close(got.float(), F.linear(normed.float(), w.float()), **kernel_tol(dtype))
    assert torch.equal(got_residual, want_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_matches_silu_and_mul_then_linear(n, k, dtype):
    gate_up, w, _ = _inputs(n, k, dtype, 5, x_len=2 * k)
    got, _ = one_row.gemv_one_row(gate_up, w, mode="silu_mul")
    want = F.linear(SiluAndMul().forward_native(gate_up).float(), w.float())
    torch.testing.assert_close(got.float(), want, **kernel_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 1024), (80, 96), (666, 264), (262, 1032), (14, 4096)])  # stacked [gate; up]
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_add_norm_silu_matches_add_norm_then_silu_and_mul(n, k, dtype, bias):
    """RMSNorm(x + residual), the stacked gate_up projection and SiLU-and-mul in one kernel: the fp32 twin within
    the kernel tolerance, and within one rounding step of the add_norm kernel followed by SiluAndMul."""
    x, w, b = _inputs(n, k, dtype, 12)
    b = b if bias else None
    residual = _inputs(n, k, dtype, 13)[0]
    norm = RMSNorm(k, 1e-6).cuda()
    norm.weight.data = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(14))).to(dtype).cuda()
    got, got_residual = one_row.gemv_one_row(x, w, b, "add_norm_silu", residual, norm.weight, norm.eps)
    assert got.shape == (1, n // 2)
    normed, want_residual = norm.forward_native(x, residual)
    want = SiluAndMul().forward_native(F.linear(normed.float(), w.float(), None if b is None else b.float()))
    torch.testing.assert_close(got.float(), want, **kernel_tol(dtype))
    assert torch.equal(got_residual, want_residual)
    two_kernels = SiluAndMul().forward_native(one_row.gemv_one_row(x, w, b, "add_norm", residual, norm.weight,
                                                                    norm.eps)[0])
    torch.testing.assert_close(got, two_kernels, atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)


@pytest.mark.gpu
def test_chain_in_cuda_graph_matches_eager():
    """Consecutive one-row GEMVs (every mode) under PDL inside a CUDA graph (each streams its weight before waiting
    on the one before) give the eager results bit for bit."""
    dtype = torch.bfloat16
    x, w1, _ = _inputs(4096, 1024, dtype, 6)
    w2, w3 = _inputs(1024, 4096, dtype, 7)[1], _inputs(6144, 1024, dtype, 8)[1]
    w4 = _inputs(1024, 3072, dtype, 9)[1]
    w5 = _inputs(6144, 1024, dtype, 10)[1]
    norm_w = torch.ones(1024, dtype=dtype, device="cuda")

    def chain(x):
        h, _ = one_row.gemv_one_row(x, w1)
        h, _ = one_row.gemv_one_row(h, w2)
        h, _ = one_row.gemv_one_row(h, w3)
        h, _ = one_row.gemv_one_row(h, w4, mode="silu_mul")
        return one_row.gemv_one_row(h, w5, mode="add_norm_silu", norm_weight=norm_w, eps=1e-6)[0]

    want = chain(x)
    for _ in range(20):  # eager, buffers reused by the caching allocator
        assert torch.equal(chain(x), want)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain(static_x)  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out = chain(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(50):  # each replay reads inputs at the addresses the replay before wrote
        static_out.zero_()
        graph.replay()
        assert torch.equal(static_out, want)


@pytest.mark.gpu
def test_fits_only_weights_whose_slice_fits_shared_memory():
    w = torch.empty(4096, 1024, dtype=torch.bfloat16, device="cuda")
    assert one_row.fits(w)
    assert not one_row.fits(torch.empty(151936, 1024, dtype=torch.bfloat16, device="cuda"))  # an LM head
    assert not one_row.fits(w.float())
    assert not one_row.fits(torch.empty(64, 100, dtype=torch.bfloat16, device="cuda"))  # K not a multiple of 8


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_then_project_fuses_one_row_on_the_gpu_only(with_residual):
    """The decoder layer's norm + projection pair on the GEMV linear method: one fused kernel for one row on a GPU
    (the unfused pair elsewhere, and for two rows); the same outputs and next residual as the unfused pair."""
    from nanovllm.layers.gemv_linear import TritonGemvLinearMethod
    from nanovllm.layers.linear import QKVLinear
    from nanovllm.models.llama import _norm_then_project

    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    torch.manual_seed(9)
    norm = RMSNorm(256, 1e-6).to(device, dtype)
    proj = QKVLinear(256, 64, 4, 2, linear_method=TritonGemvLinearMethod()).to(device, dtype)
    torch.nn.init.normal_(proj.weight, std=0.05)
    norm.weight.data += 0.1 * torch.randn(256, device=device, dtype=dtype)
    for rows in (1, 2):
        x = torch.randn(rows, 256, device=device, dtype=dtype)
        residual = torch.randn(rows, 256, device=device, dtype=dtype) if with_residual else None
        normed, want_residual = norm.forward_native(x, residual) if with_residual else (norm.forward_native(x), x)
        fused = proj.linear_method.apply_add_rms_norm(proj, x, residual, norm)
        assert (fused is not None) == (device == "cuda" and rows == 1)
        got, got_residual = _norm_then_project(norm, proj, x, residual)
        torch.testing.assert_close(got.float(), F.linear(normed.float(), proj.weight.float()), **kernel_tol(dtype))
        assert torch.equal(got_residual, want_residual)


def _mlps():
    """(device, dtype, the MLP on its native path, a copy on the GEMV linear method), small random weights."""
    import copy
    from types import SimpleNamespace

    from nanovllm.layers.gemv_linear import TritonGemvLinearMethod
    from nanovllm.models.llama import LlamaMLP

    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    torch.manual_seed(7)
    native = LlamaMLP(SimpleNamespace(hidden_size=256, intermediate_size=384, hidden_act="silu")).to(device, dtype)
    for param in native.parameters():
        torch.nn.init.normal_(param, std=0.05)
    mlp = copy.deepcopy(native)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.linear_method = TritonGemvLinearMethod()
    return device, dtype, native, mlp


def test_mlp_fuses_silu_and_mul_into_down_for_one_row_on_the_gpu_only():
    device, dtype, native, mlp = _mlps()
    for rows in (1, 2):
        x = torch.randn(rows, 256, device=device, dtype=dtype)
        fused = mlp.down_proj.linear_method.apply_silu_and_mul(mlp.down_proj, mlp.gate_up_proj(x))
        assert (fused is not None) == (device == "cuda" and rows == 1)
        torch.testing.assert_close(mlp(x).float(), native(x).float(), **kernel_tol(dtype))


def test_mlp_after_norm_fuses_norm_and_silu_into_gate_up_for_one_row_on_the_gpu_only():
    """The decoder layer's second half: one kernel for the norm, gate_up_proj and SiLU-and-mul (one row, GPU), then
    down_proj; the native MLP after the native norm elsewhere; the same outputs and next residual."""
    device, dtype, native, mlp = _mlps()
    norm = RMSNorm(256, 1e-6).to(device)
    norm.weight.data = (1 + 0.1 * torch.randn(256, device=device)).to(dtype)
    for rows in (1, 2):
        x, residual = (torch.randn(rows, 256, device=device, dtype=dtype) for _ in range(2))
        fused = mlp.gate_up_proj.linear_method.apply_add_rms_norm(mlp.gate_up_proj, x, residual, norm,
                                                                  silu_and_mul=True)
        assert (fused is not None) == (device == "cuda" and rows == 1)
        got, got_residual = mlp.after_norm(norm, x, residual)
        normed, want_residual = norm.forward_native(x, residual)
        torch.testing.assert_close(got.float(), native(normed).float(), **kernel_tol(dtype))
        assert torch.equal(got_residual, want_residual)


def test_off_without_a_gpu_says_why():
    assert one_row.why_off(torch.device("cpu")) == "no CUDA GPU"
    assert not one_row.fits(torch.empty(64, 64, dtype=torch.bfloat16))

