"""The linear-attention kernels against their plain torch twins (layers/linear_attention.py): the decode step's
Triton kernels on state slots in place (under the Triton interpreter on CPU, at Qwen3-Next's shapes on the GPU),
and on the GPU fla-core's varlen prefill from given states."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.gated_delta_decode import conv1d_step, gated_delta_rule_step_slots
from nanovllm.layers.linear_attention import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_rule_chunked,
    gated_delta_rule_step,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _l2norm(x):
    return x.float() * torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)


def _decode_inputs(rows, hk, hv, dk, dv, width, num_slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dim = 2 * hk * dk + hv * dv
    x = torch.randn(rows, dim + 5, generator=g)[:, :dim]  # strided rows, as a slice of a projection
    ab = torch.randn(rows, 2 * hv, generator=g)
    a, b = ab[:, :hv], ab[:, hv:]
    weight = torch.randn(dim, width, generator=g)
    a_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    conv_state = torch.randn(num_slots, dim, width - 1, generator=g)
    ssm_state = torch.randn(num_slots, hv, dk, dv, generator=g) * 0.1
    slots = torch.randperm(num_slots, generator=g)[:rows].to(torch.int32)
    seq_lens = torch.randint(1, 50, (rows,), generator=g).to(torch.int32)
    seq_lens[0] = 1  # a one-token prompt: from zeros
    cast = [x.to(dtype), a.to(dtype), b.to(dtype), weight.to(dtype)]
    return [t.to(DEVICE) for t in (*cast, a_log, dt_bias, conv_state, ssm_state, slots, seq_lens)]


@pytest.mark.parametrize("rows,hk,hv,dk,dv,width", [(3, 2, 4, 16, 8, 4), (2, 1, 3, 12, 20, 3), (4, 2, 2, 8, 40, 2)])
def test_decode_kernels_equal_the_torch_step(rows, hk, hv, dk, dv, width):
    _check_decode(rows, hk, hv, dk, dv, width, torch.float32, 2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_decode_kernels_at_qwen3_next_shapes(rows, dtype):
    _check_decode(rows, 16, 32, 128, 128, 4, dtype, 2e-5 if dtype == torch.float32 else 2e-2)


def _check_decode(rows, hk, hv, dk, dv, width, dtype, tol):
    x, a, b, weight, a_log, dt_bias, conv_state, ssm_state, slots, seq_lens = \
        _decode_inputs(rows, hk, hv, dk, dv, width, rows + 3, dtype, rows + dk)
    padded_slots = torch.cat([slots, torch.full((2,), -1, dtype=torch.int32, device=DEVICE)])  # graph padding rows
    padded = [torch.cat([t, t[:2]]) for t in (x, a, b, seq_lens)]
    conv_before, ssm_before = conv_state.clone(), ssm_state.clone()

    y = conv1d_step(padded[0], weight, conv_state, padded_slots, padded[3])
    out = gated_delta_rule_step_slots(y, padded[1], padded[2], a_log, dt_bias, ssm_state, padded_slots, padded[3], hk)

    kept = (seq_lens > 1).float()[:, None, None]
    idx = slots.long()
    want_y, want_conv = causal_conv1d_step(x.float(), weight.float(), None, conv_before[idx] * kept)
    q, k, v = want_y.split([hk * dk, hk * dk, hv * dv], -1)
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    want_out, want_ssm = gated_delta_rule_step(_l2norm(q.reshape(rows, hk, dk)), _l2norm(k.reshape(rows, hk, dk)),
                                               v.reshape(rows, hv, dv), g, b.float().sigmoid(),
                                               ssm_before[idx] * kept[..., None])
    torch.testing.assert_close(y[:rows].float(), want_y, atol=tol, rtol=tol)
    torch.testing.assert_close(out[:rows].float(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(conv_state[idx], want_conv.to(conv_state.dtype), atol=tol, rtol=tol)
    torch.testing.assert_close(ssm_state[idx], want_ssm, atol=tol, rtol=tol)
    assert (y[rows:] == 0).all() and (out[rows:] == 0).all()  # padding rows: zeros, and no state touched
    untouched = torch.ones(conv_state.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[idx] = False
    assert torch.equal(conv_state[untouched], conv_before[untouched])
    assert torch.equal(ssm_state[untouched], ssm_before[untouched])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_equals_the_torch_chunked_rule(dtype):
    """Prompts of 1 to 130 tokens in one varlen launch, from given states (one fresh), against one at a time."""
    pytest.importorskip("fla")
    from nanovllm.layers.fla_prefill import prefill_varlen

    hk, hv, dk, dv, width, lens = 2, 4, 64, 32, 4, [5, 70, 1, 130]
    g_ = torch.Generator().manual_seed(0)
    dim, tokens = 2 * hk * dk + hv * dv, sum(lens)
    mixed = torch.randn(tokens, dim, generator=g_).to(dtype).to(DEVICE)
    weight = torch.randn(dim, width, generator=g_).to(dtype).to(DEVICE)
    g = (-torch.rand(tokens, hv, generator=g_) * 0.5).to(DEVICE)
    beta = torch.rand(tokens, hv, generator=g_).to(dtype).to(DEVICE)
    conv0 = torch.randn(len(lens), dim, width - 1, generator=g_).to(DEVICE)
    ssm0 = (torch.randn(len(lens), hv, dk, dv, generator=g_) * 0.1).to(DEVICE)
    conv0[1], ssm0[1] = 0, 0  # a fresh prompt
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    out, (conv1, ssm1) = prefill_varlen(mixed, g, beta, weight, conv0, ssm0, cu, hk, dk, hv)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        y, conv_after = causal_conv1d(mixed[start:end].float(), weight.float(), None, conv0[i])
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], -1)
        n = end - start
        want, ssm_after = gated_delta_rule_chunked(_l2norm(q.reshape(n, hk, dk)), _l2norm(k.reshape(n, hk, dk)),
                                                   v.reshape(n, hv, dv), g[start:end], beta[start:end].float(), ssm0[i])
        torch.testing.assert_close(out[start:end].float(), want, **tol)
        torch.testing.assert_close(conv1[i].float(), conv_after, **tol)
        torch.testing.assert_close(ssm1[i], ssm_after, **tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 1e-2, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter truncates bf16")])])
@pytest.mark.parametrize("tokens,heads,dim", [(5, 4, 24), (1, 32, 128), (0, 2, 8)])
def test_the_gated_rms_norm_kernel_is_the_twin(dtype, tol, tokens, heads, dim):
    """The fused gated RMSNorm against GatedDeltaNet's torch twin, z a strided slice of a projection's rows."""
    from types import SimpleNamespace

    from nanovllm.kernels.gated_rms_norm import gated_rms_norm
    from nanovllm.models.qwen3_next import GatedDeltaNet

    g = torch.Generator().manual_seed(tokens + heads)
    x = torch.randn(tokens, heads, dim, generator=g).to(DEVICE, dtype)
    z = torch.randn(tokens, heads * dim + 7, generator=g).to(DEVICE, dtype)[:, 3:3 + heads * dim].view(
        tokens, heads, dim)
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    twin = SimpleNamespace(norm=SimpleNamespace(weight=weight), eps=1e-6, use_triton=False)
    want = GatedDeltaNet._gated_norm(twin, x, z)
    got = gated_rms_norm(x, z, weight, 1e-6)
    assert got.shape == (tokens, heads * dim) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
