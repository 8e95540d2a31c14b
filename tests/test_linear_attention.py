"""The gated delta rule's torch twin (layers/linear_attention.py): the chunked form equals the token-by-token one and
HF transformers' reference (Qwen3-Next's torch path), a prompt split in two (the state carried) equals it whole, and
the causal conv1d with its carried state equals one convolution over the whole input."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.linear_attention import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_recurrent


def inputs(tokens: int, k_heads: int = 2, v_heads: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, k_heads, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(tokens, k_heads, dk, generator=g), dim=-1)
    v = torch.randn(tokens, v_heads, dv, generator=g)
    decay = -F.softplus(torch.randn(tokens, v_heads, generator=g)) * 0.3  # log decay, <= 0
    beta = torch.randn(tokens, v_heads, generator=g).sigmoid()
    state = torch.randn(v_heads, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 70])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(tokens, with_state):
    q, k, v, decay, beta, state = inputs(tokens, seed=tokens)
    state = state if with_state else None
    want, want_state = gated_delta_rule_recurrent(q, k, v, decay, beta, state)
    got, got_state = gated_delta_rule_chunked(q, k, v, decay, beta, state, chunk=16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=2e-5, rtol=1e-4)


def test_a_prompt_split_in_two_continues_from_its_state():
    q, k, v, decay, beta, _ = inputs(50, seed=7)
    whole, whole_state = gated_delta_rule_chunked(q, k, v, decay, beta, chunk=16)
    first, state = gated_delta_rule_chunked(q[:23], k[:23], v[:23], decay[:23], beta[:23], chunk=16)
    rest, last_state = gated_delta_rule_chunked(q[23:], k[23:], v[23:], decay[23:], beta[23:], state, chunk=16)
    decode, decode_state = gated_delta_rule_recurrent(q[23:], k[23:], v[23:], decay[23:], beta[23:], state)
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(last_state, whole_state, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(decode, rest, atol=2e-5, rtol=1e-4)


def test_equals_hf_transformers_reference():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, decay, beta, state = inputs(40, seed=3)
    want, want_state = modeling.torch_chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                                             chunk_size=16, initial_state=state[None],
                                                             output_final_state=True)
    got, got_state = gated_delta_rule_chunked(q, k, v, decay, beta, state, chunk=16)
    torch.testing.assert_close(got, want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 3, 9])
def test_causal_conv1d_carries_its_state(split):
    g = torch.Generator().manual_seed(split)
    x, weight, bias = torch.randn(12, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    whole = F.silu(F.conv1d(F.pad(x.t()[None], (3, 0)), weight[:, None], bias, groups=6)[0]).t()
    first, state = causal_conv1d(x[:split], weight, bias)
    rest, final = causal_conv1d(x[split:], weight, bias, state)
    torch.testing.assert_close(torch.cat([first, rest]), whole)
    torch.testing.assert_close(final, x[-3:].t())


def test_a_batched_decode_step_equals_each_sequence_alone():
    """gated_delta_rule_step and causal_conv1d_step over 3 sequences at once: each sequence's recurrent token."""
    from nanovllm.layers.linear_attention import causal_conv1d_step, gated_delta_rule_step

    g = torch.Generator().manual_seed(5)
    b, hk, hv, dk, dv, channels, width = 3, 2, 4, 8, 6, 10, 4
    q, k = torch.randn(b, hk, dk, generator=g), torch.randn(b, hk, dk, generator=g)
    v, gate, beta = torch.randn(b, hv, dv, generator=g), -torch.rand(b, hv, generator=g), torch.rand(b, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    out, after = gated_delta_rule_step(q, k, v, gate, beta, state)
    x, conv_state, weight = torch.randn(b, channels, generator=g), torch.randn(b, channels, width - 1, generator=g), \
        torch.randn(channels, width, generator=g)
    y, conv_after = causal_conv1d_step(x, weight, None, conv_state)
    for i in range(b):
        want, want_state = gated_delta_rule_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], gate[i:i + 1],
                                                      beta[i:i + 1], state[i])
        torch.testing.assert_close(out[i], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(after[i], want_state, atol=1e-5, rtol=1e-5)
        want_y, want_conv = causal_conv1d(x[i:i + 1], weight, None, conv_state[i])
        torch.testing.assert_close(y[i], want_y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_after[i], want_conv, atol=1e-6, rtol=1e-6)
