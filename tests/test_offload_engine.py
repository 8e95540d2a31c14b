"""Attention over KV blocks in the host pool, streamed through a ring of slots (kvcache/offload_engine.py), against
one attention over the whole gathered context; the log-sum-exp merge (attention/merge.py) against unsplit attention
and torch's scaled_dot_product_attention. On CPU the ring is host tensors; on CUDA (gpu) streams, events and sgDMA."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.attention.merge import attention_with_lse, merge_parts
from nanovllm.kvcache.offload_engine import OffloadEngine, slot_splits, split_lengths

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 3, 24, 4, 2, 4, 16  # the compiled dot needs 16
SCALE = HEAD_DIM ** -0.5


def pool(device="cpu") -> torch.Tensor:
    values = torch.randn(2, LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    return values.pin_memory() if device == "cuda" else values


def query(n: int) -> torch.Tensor:
    return torch.randn(n, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))


def test_attention_with_lse_is_sdpa():
    q, k, v = query(3), torch.randn(10, KV_HEADS, HEAD_DIM), torch.randn(10, KV_HEADS, HEAD_DIM)
    out, lse = attention_with_lse(q, k, v, SCALE)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=SCALE,
                                          enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    scores = torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(HEADS // KV_HEADS, 1)) * SCALE
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


@pytest.mark.parametrize("split", [1, 5, 9])
def test_merged_parts_are_the_whole(split):
    q, k, v = query(2), torch.randn(10, KV_HEADS, HEAD_DIM), torch.randn(10, KV_HEADS, HEAD_DIM)
    first, second = attention_with_lse(q, k[:split], v[:split], SCALE), attention_with_lse(q, k[split:], v[split:], SCALE)
    merged = merge_parts(*(torch.stack(pair) for pair in zip(first, second)))
    for got, want in zip(merged, attention_with_lse(q, k, v, SCALE)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_merge_is_the_torch_one(device, parts, dtype):
    """merge_parts_fused (one Triton kernel; the interpreter on CPU) against merge_parts, into rows of a wider
    tensor (a step's output, strided) in the model's dtype."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the Triton kernels run on host tensors only in the interpreter (CI)")
    from nanovllm.kernels.merge_attention import merge_parts_fused

    g = torch.Generator().manual_seed(parts)
    outs = torch.randn(parts, 3, HEADS, HEAD_DIM, generator=g).to(device)
    lses = (4 * torch.randn(parts, 3, HEADS, generator=g)).to(device)
    want_out, want_lse = merge_parts(outs, lses)
    wide = torch.zeros(5, HEADS, HEAD_DIM, dtype=dtype, device=device)
    lse = torch.empty(3, HEADS, device=device)
    merge_parts_fused(outs, lses, wide[1:4], lse)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(wide[1:4].float().cpu(), want_out.cpu(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), rtol=1e-5, atol=1e-5)
    assert not wide[0].any() and not wide[4].any()  # no row outside the slice written


def gathered(pool_: torch.Tensor, layer: int, blocks: list[int], length: int):
    return [pool_[kv, layer, blocks].flatten(0, 1)[:length] for kv in (0, 1)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("num_slots,slot_blocks", [(1, 1), (2, 1), (3, 2), (2, 8)])
@pytest.mark.parametrize("length", [1, 13, 37])
@pytest.mark.parametrize("fast", [False, True])  # plain torch, or the Triton paged decode over each slot
def test_ring_attention_is_attention_over_the_gathered_context(device, num_slots, slot_blocks, length, fast):
    if fast:
        pytest.importorskip("triton")
        if device == "cpu" and torch.cuda.is_available():
            pytest.skip("the Triton kernels run on host tensors only in the interpreter (CI)")
    host = pool(device)
    engine = OffloadEngine(host, num_slots, slot_blocks, torch.device(device), fast=fast)
    blocks = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(length))[:-(-length // BLOCK_SIZE)].tolist()
    for layer in range(LAYERS):
        q = query(3).to(device)
        out, lse = engine.attend(layer, q, blocks, length, SCALE)
        k, v = gathered(host, layer, blocks, length)
        want_out, want_lse = attention_with_lse(q.cpu(), k, v, SCALE)
        tol = 1e-4 if fast else 1e-5  # the kernel sums in another order
        torch.testing.assert_close(out.cpu(), want_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.cpu(), want_lse, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_a_prompt_chunk_attends_to_each_slot_by_fused_attention(dtype, tol):
    """More rows than the paged decode takes (a prompt chunk) go by torch's flash / memory-efficient attention."""
    host = pool("cuda").to(dtype).pin_memory()
    engine = OffloadEngine(host, 2, 2, torch.device("cuda"), fast=True)
    blocks, length = [5, 2, 7, 11, 3], 19
    q = query(40).to("cuda", dtype)
    for layer in range(LAYERS):
        out, lse = engine.attend(layer, q, blocks, length, SCALE)
        want_out, want_lse = attention_with_lse(q.cpu(), *gathered(host, layer, blocks, length), SCALE)
        torch.testing.assert_close(out.cpu(), want_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.cpu(), want_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("capacity", [16, 500, 3000, 32768, 65536])
def test_the_warm_up_lengths_take_every_split_count_a_slot_can(capacity):
    assert {slot_splits(t) for t in split_lengths(capacity)} == {slot_splits(t) for t in range(1, capacity + 1)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_after_the_warm_up_no_slot_length_compiles_a_kernel():
    from nanovllm.kernels import paged_attention

    caches = getattr(paged_attention._decode_split_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    blocks = 5000  # one slot of 20,000 tokens: every split count
    host = torch.randn(2, 1, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).pin_memory()
    engine = OffloadEngine(host, 2, blocks, torch.device("cuda"), fast=True)
    engine.warm_up(HEADS)
    if not all(isinstance(cache, tuple) and isinstance(cache[0], dict) for cache in caches.values()):
        pytest.skip("this Triton keeps its compiled kernels in another form")
    compiled = sum(len(cache[0]) for cache in caches.values())
    for length in (700, 1500, 3000, 6000, 12000, 20000):
        q = query(1).cuda()
        out, _ = engine.attend(0, q, list(range(-(-length // BLOCK_SIZE))), length, SCALE)
        want, _ = attention_with_lse(q.cpu(), *gathered(host, 0, list(range(-(-length // BLOCK_SIZE))), length), SCALE)
        torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)
    assert sum(len(cache[0]) for cache in caches.values()) == compiled


def test_bad_ring_or_lengths_name_the_problem():
    with pytest.raises(ValueError, match="at least one slot of one block"):
        OffloadEngine(pool(), 0, 1, torch.device("cpu"))
    engine = OffloadEngine(pool(), 2, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="9 tokens are not held by 2 blocks of 4"):
        engine.attend(0, query(1), [0, 1], 9, SCALE)


def test_long_contexts_go_a_few_queries_at_a_time(monkeypatch):
    """The scores of one chunk of queries stay under SCORES_BYTES; the chunks give what one pass gives."""
    from nanovllm.attention import merge

    q, k, v = query(9), torch.randn(20, KV_HEADS, HEAD_DIM), torch.randn(20, KV_HEADS, HEAD_DIM)
    mask = torch.rand(9, 20, generator=torch.Generator().manual_seed(3)) < 0.7
    mask[:, 0] = True
    whole = attention_with_lse(q, k, v, SCALE, mask)
    monkeypatch.setattr(merge, "SCORES_BYTES", 4 * HEADS * 20 * 2)  # two queries a chunk
    for got, want in zip(attention_with_lse(q, k, v, SCALE, mask), whole):
        torch.testing.assert_close(got, want)


def test_the_ring_loads_the_next_layers_parts_while_this_one_is_attended_to():
    engine = OffloadEngine(pool(), 2, 2, torch.device("cpu"))
    blocks = [[3, 4, 5], [9, 1]]  # two sequences: 2 parts and 1 part a layer
    engine.plan([(layer, part) for layer in range(LAYERS) for b in blocks for part in engine.parts(b)])
    assert [entry[1:] for entry in engine.in_ring] == [(0, [3, 4]), (0, [5])]
    engine.attend(0, query(1), blocks[0], 12, SCALE)
    assert [entry[1:] for entry in engine.in_ring] == [(0, [9, 1]), (1, [3, 4])]  # layer 1 already loading
    engine.attend(0, query(1), blocks[1], 8, SCALE)
    for layer in (1, 2):
        for b in blocks:
            out, _ = engine.attend(layer, query(1), b, len(b) * BLOCK_SIZE, SCALE)
            want, _ = attention_with_lse(query(1), *gathered(engine.pool, layer, b, len(b) * BLOCK_SIZE), SCALE)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not engine.in_ring and not engine.pending


def test_paged_decode_gives_the_log_sum_exp():
    pytest.importorskip("triton")
    from nanovllm.kernels.paged_attention import paged_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = pool(device)[:, 0].to(device)  # [2, blocks, block_size, kv_heads, D] of one layer
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([14, 6], dtype=torch.int32, device=device)
    q = query(2).to(device)
    lse = torch.empty(2, HEADS, device=device)
    out = paged_decode(q, cache[0], cache[1], tables, lens, SCALE, 1, lse=lse)
    for row, n in enumerate((14, 6)):
        blocks = tables[row, :-(-n // BLOCK_SIZE)].long()
        k, v = (cache[kv][blocks].flatten(0, 1)[:n].cpu() for kv in (0, 1))
        want_out, want_lse = attention_with_lse(q[row:row + 1].cpu(), k, v, SCALE)
        torch.testing.assert_close(out[row:row + 1].cpu(), want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[row:row + 1].cpu(), want_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), pytest.param(torch.bfloat16, 2e-2, marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter truncates bf16")])])
def test_the_fast_step_attends_as_the_torch_one(dtype, tol):
    """A step of two decodes (one with offloaded blocks) and a prompt chunk with offloaded blocks: the Triton path
    (paged decode with log-sum-exp over resident blocks and slots, the fused merge) against plain torch."""
    pytest.importorskip("triton")
    from nanovllm.attention.metadata import AttentionMetadata

    device = "cuda" if torch.cuda.is_available() else "cpu"
    host = pool(device).to(dtype)
    host = host.pin_memory() if device == "cuda" else host
    g = torch.Generator().manual_seed(5)
    kv_cache = torch.randn(2, LAYERS, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    # seq 0: 2 host blocks + device blocks 4, 9 (14 tokens); seq 1: no host blocks, device 1, 2 (6); seq 2: 1 host
    # block + device 3, 5, 6 and a chunk of 5 new tokens at positions 11..15 (16 tokens)
    offloaded = [[3, 8], [], [11]]
    tables = torch.tensor([[-1, -1, 4, 9], [1, 2, 0, 0], [-1, 3, 5, 6]], dtype=torch.int32, device=device)
    seq_lens = [14, 6, 16]
    new = [(13,), (5,), tuple(range(11, 16))]
    slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for i, ps in enumerate(new) for p in ps]
    starts = [0, 1, 2, 7]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), query_start_loc=torch.tensor(starts, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables=tables, num_decodes=2,
        max_query_len=5, max_seq_len=16, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, offloaded=offloaded)
    q = torch.randn(7, HEADS, HEAD_DIM, generator=g).to(device, dtype)
    k, v = (torch.randn(7, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
    outs = []
    for fast in (False, True):
        engine = OffloadEngine(host, 2, 1, torch.device(device), fast=fast)
        cache = kv_cache.clone()
        outs.append([engine.forward(layer, q, k, v, cache[0, layer], cache[1, layer], meta, SCALE)
                     for layer in range(LAYERS)])
    for want, got in zip(*outs):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_pack_decodes_runs_consecutive_decodes_that_share_a_slot():
    from nanovllm.kvcache.offload_engine import pack_decodes

    offloaded = [[1], [2, 3], [4], [], [5, 6, 7, 8], [9], [10, 11], [12]]
    assert pack_decodes(offloaded, 7, 3) == [(0, 2), (2, 3), (5, 7)]  # 8 is a prompt chunk; 4 needs two slots
    assert pack_decodes(offloaded, 8, 4) == [(0, 3), (4, 5), (5, 8)]
    assert pack_decodes([[], []], 2, 4) == []


@pytest.mark.parametrize("fast", [False, True])
def test_decodes_sharing_a_slot_attend_as_the_whole_context(fast):
    """A step of decodes packed into shared slots, one too long to share, one with no host blocks, and a prompt chunk:
    every row equals causal attention over its sequence's gathered context (host blocks, then resident ones)."""
    if fast:
        pytest.importorskip("triton")
    from nanovllm.attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(7)
    host = pool()
    kv_cache = torch.randn(2, LAYERS, 24, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    offloaded = [[3], [8, 2], [], [11, 5, 7, 13], [1], [6]]  # slots of 3 blocks: groups (0, 2) and (4, 5)
    resident = [[4], [9, 10], [12, 14], [15], [16, 17], [18, 19]]  # device blocks after the host ones
    seq_lens = [6, 11, 7, 17, 10, 12]
    new_tokens = [1, 1, 1, 1, 1, 4]  # the last: a prompt chunk
    width = max(len(h) + len(r) for h, r in zip(offloaded, resident))
    tables = torch.tensor([[-1] * len(h) + r + [0] * (width - len(h) - len(r)) for h, r in zip(offloaded, resident)],
                          dtype=torch.int32)
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (n, L) in enumerate(zip(new_tokens, seq_lens)) for p in range(L - n, L)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(
            seq_lens, dtype=torch.int32), block_tables=tables, num_decodes=5, max_query_len=4, max_seq_len=17,
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens, offloaded=offloaded)
    rows = starts[-1]
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    engine = OffloadEngine(host, 2, 3, torch.device("cpu"), fast=fast)
    assert [(grp.first, grp.last) for grp in engine._groups(meta, q.device)[0]] == [(0, 2), (4, 5)]
    cache = kv_cache.clone()
    for layer in range(LAYERS):
        got = engine.forward(layer, q, k, v, cache[0, layer], cache[1, layer], meta, SCALE)
        for i, (s, e) in enumerate(zip(starts, starts[1:])):
            keys, values = (torch.cat([host[kv, layer, offloaded[i]].flatten(0, 1),
                                       cache[kv, layer, resident[i]].flatten(0, 1)])[:seq_lens[i]] for kv in (0, 1))
            positions = torch.arange(seq_lens[i])
            mask = positions[None, :] <= positions[seq_lens[i] - (e - s):, None]
            want, _ = attention_with_lse(q[s:e], keys, values, SCALE, mask)
            torch.testing.assert_close(got[s:e], want, rtol=1e-4, atol=1e-4)
    assert not engine.in_ring and not engine.pending
