"""The fused MoE kernels (kernels/fused_moe.py) against the per-expert loop: on CPU under the Triton interpreter at
tiny sizes, on the GPU at Qwen3-30B-A3B's expert shape, eagerly and replayed from a CUDA graph."""
import pytest
import torch
from helpers import kernel_tol

from nanovllm.kernels import fused_moe as kernels
from nanovllm.kernels.fused_moe import align_pairs, fused_moe, route
from nanovllm.layers.fused_moe import moe_per_expert, moe_sorted, route_top_k

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(tokens, num_experts, top_k, hidden, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5
    weights, ids = route_top_k(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


def _reference(x, w13, w2, weights, ids):
    return moe_per_expert(x.float(), w13.float(), w2.float(), weights.float(), ids)


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 8, 2), (5, 7, 3), (33, 4, 2), (20, 9, 1)])
def test_fused_moe_equals_the_per_expert_loop(tokens, num_experts, top_k):
    x, w13, w2, weights, ids = _experts(tokens, num_experts, top_k, 48, 40, torch.float32, tokens)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), _reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("one_program", [True, False])
def test_each_tile_holds_one_experts_pairs_once(one_program, monkeypatch):
    """Both ways of sorting the pairs: one program (decode) and the torch ops (many pairs)."""
    monkeypatch.setattr(kernels, "ALIGN_IN_ONE_PROGRAM", 4096 if one_program else 0)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([[3, 0], [3, 1], [0, 3], [2, 3]]),
                     torch.randint(0, 9, (70, 2), generator=g)]).to(DEVICE)  # more pairs than a program's chunk
    num_experts, block_m = 10, 4
    sorted_ids, tile_experts, rows_used = align_pairs(ids, num_experts, block_m)
    flat = ids.flatten().tolist()
    used = sorted_ids[:rows_used.item()].view(-1, block_m).tolist()
    assert sorted(p for tile in used for p in tile if p < len(flat)) == list(range(len(flat)))
    for tile, expert in zip(used, tile_experts.tolist()):
        assert {flat[p] for p in tile if p < len(flat)} == {expert}
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert rows_used.item() == ((counts + block_m - 1) // block_m * block_m).sum()  # expert 9 routes nothing
    assert (sorted_ids[rows_used.item():] == len(flat)).all()


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (7, 3), (128, 8)])
def test_routing_in_one_launch_equals_route_top_k(num_experts, top_k, renormalize):
    logits = torch.randn(6, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize)
    want_weights, want_ids = route_top_k(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 64, 256, 2048])
def test_fused_moe_at_qwen3_30b_a3b_shape(tokens, dtype):
    """128 experts, top 8, hidden 2048, expert width 768; and replayed from a CUDA graph with other routing."""
    x, w13, w2, weights, ids = _experts(tokens, 128, 8, 2048, 768, dtype, tokens)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids).float(), _reference(x, w13, w2, weights, ids),
                               **kernel_tol(dtype))
    static = [t.clone() for t in (x, weights, ids)]
    fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    x2, _, _, weights2, ids2 = _experts(tokens, 128, 8, 2048, 768, dtype, tokens + 1)
    for buffer, value in zip(static, (x2, weights2, ids2)):
        buffer.copy_(value)
    graph.replay()
    torch.testing.assert_close(out.float(), _reference(x2, w13, w2, weights2, ids2), **kernel_tol(dtype))


@pytest.mark.parametrize("one_program", [True, False])
def test_pairs_left_out_add_nothing(one_program, monkeypatch):
    """ids of -1 (experts held elsewhere, streaming/expert_offload.py): the fused kernels and the sorted torch path
    sum only the other pairs."""
    monkeypatch.setattr(kernels, "ALIGN_IN_ONE_PROGRAM", 4096 if one_program else 0)
    x, w13, w2, weights, ids = _experts(9, 6, 3, 32, 24, torch.float32, 7)
    left_out = ids.clone()
    left_out[ids % 2 == 1] = -1
    kept_weights = torch.where(left_out < 0, 0, weights)
    want = _reference(x, w13, w2, kept_weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, left_out, leaves_out=True), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe_sorted(x, w13, w2, weights, left_out), want, atol=1e-5, rtol=1e-5)


def _q4k_experts(num_experts, hidden, inter, seed):
    """gate, up [E x I, H] and down [E x H, I] as random Q4_K blocks."""
    import numpy as np
    from helpers import random_tensor

    from nanovllm.quant.gguf_weight import GGUFWeight

    rng = np.random.default_rng(seed)
    shapes = [(num_experts * inter, hidden), (num_experts * inter, hidden), (num_experts * hidden, inter)]
    return [GGUFWeight.from_blocks(torch.from_numpy(random_tensor("Q4_K", n, k, rng)), "Q4_K", (n, k)).to(DEVICE)
            for n, k in shapes]


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 4, 2), (7, 5, 3), (40, 3, 2)])
def test_q4_k_experts_equal_their_dequantized_loop(tokens, num_experts, top_k):
    """The Q4_K kernels (kernels/fused_moe_q4k.py) against the per-expert loop over the dequantized blocks (fp32,
    the interpreter on CPU; a pair left out where leaves_out)."""
    from nanovllm.kernels.fused_moe_q4k import fused_moe_q4k

    hidden, inter = 256, 512
    gate, up, down = _q4k_experts(num_experts, hidden, inter, tokens)
    w13 = torch.cat([gate.dequantize().view(num_experts, inter, hidden),
                     up.dequantize().view(num_experts, inter, hidden)], 1)
    w2 = down.dequantize().view(num_experts, hidden, inter)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    weights, ids = route_top_k(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    want = moe_per_expert(x, w13.to(DEVICE), w2.to(DEVICE), weights, ids)
    got = fused_moe_q4k(x, gate, up, down, weights, ids, num_experts)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
    ids[0, 0] = -1  # a pair left out: its expert not among these
    want = moe_per_expert(x, w13.to(DEVICE), w2.to(DEVICE), weights * (ids >= 0), ids.clamp(min=0))
    got = fused_moe_q4k(x, gate, up, down, weights, ids, num_experts, leaves_out=True)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_q4_k_experts_at_qwen3_30b_a3b_shape(tokens):
    """128 Q4_K experts of 2048 x 768, top 8, bf16 activations: the dequantized loop's output, eagerly and replayed
    from a CUDA graph."""
    from helpers import kernel_tol

    from nanovllm.kernels.fused_moe_q4k import fused_moe_q4k

    num_experts, hidden, inter = 128, 2048, 768
    gate, up, down = _q4k_experts(num_experts, hidden, inter, tokens)
    w13 = torch.cat([gate.dequantize().view(num_experts, inter, hidden),
                     up.dequantize().view(num_experts, inter, hidden)], 1)
    w2 = down.dequantize().view(num_experts, hidden, inter)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = (t.to(DEVICE) for t in route_top_k(torch.randn(tokens, num_experts, generator=g), 8, True))
    want = moe_per_expert(x.float(), w13, w2, weights.float(), ids)
    got = fused_moe_q4k(x, gate, up, down, weights.to(torch.bfloat16), ids, num_experts)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float() / scale, want / scale, **kernel_tol(torch.bfloat16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_moe_q4k(x, gate, up, down, weights.to(torch.bfloat16), ids, num_experts)
    graph.replay()
    assert torch.equal(replayed, got)
