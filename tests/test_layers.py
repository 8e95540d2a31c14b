"""Fast paths against their plain twins on CPU."""
import pytest
import torch

from nanovllm.attention.torch_backend import context_slots, decode_reference, gather_context, prefill_reference
from nanovllm.layers.linear import CpuPackedLinearMethod, ReplicatedLinear, UnquantizedLinearMethod


@pytest.mark.skipif(not CpuPackedLinearMethod.available(), reason="no oneDNN packed linear in this torch")
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_cpu_linear_matches_f_linear(rows):
    layer = ReplicatedLinear(96, 200, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 96)
    want = UnquantizedLinearMethod().apply(layer, x)
    fast = CpuPackedLinearMethod()
    fast.process_weights_after_loading(layer)
    torch.testing.assert_close(fast.apply(layer, x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fast.apply(layer, x.view(1, rows, 96)), want.view(1, rows, 200), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_methods_write_into_out_as_they_return(bias):
    """apply(..., out=buf), how a CUDA graph takes the LM head's logits without a copy, writes the very values
    apply returns."""
    layer = ReplicatedLinear(96, 200, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(7, 96)
    methods = [UnquantizedLinearMethod()]
    if CpuPackedLinearMethod.available():
        methods.append(CpuPackedLinearMethod())
        methods[-1].process_weights_after_loading(layer)
    for method in methods:
        out = torch.full((7, 200), float("nan"))
        assert method.apply(layer, x, out=out) is out
        assert torch.equal(out, method.apply(layer, x))


def test_batched_decode_matches_per_sequence_attention():
    """The batched decode path equals attending each sequence alone, with NaN in every unwritten slot."""
    g = torch.Generator().manual_seed(0)
    blocks, bs, hk, heads, d = 40, 4, 2, 6, 16
    k_cache = torch.full((blocks, bs, hk, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    lens = [1, 5, 8, 13]
    tables = torch.zeros(len(lens), 4, dtype=torch.int32)
    perm = torch.randperm(blocks, generator=g)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        for p in range(n):
            b = tables[i, p // bs]
            k_cache[b, p % bs] = torch.randn(hk, d, generator=g)
            v_cache[b, p % bs] = torch.randn(hk, d, generator=g)
    q = torch.randn(len(lens), heads, d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = decode_reference(q, k_cache, v_cache, *context_slots(tables, seq_lens, max(lens), bs), 0.25)
    for i, n in enumerate(lens):
        k_new, v_new = (gather_context(c, tables[i], n)[-1:] for c in (k_cache, v_cache))
        want = prefill_reference(q[i:i + 1], k_new, v_new, k_cache, v_cache, tables[i], n, 0.25)
        torch.testing.assert_close(got[i:i + 1], want)
    assert not got.isnan().any()
