"""Triton kernels against their torch references: on CPU under TRITON_INTERPRET=1 at tiny sizes (set by
conftest), on the GPU (marked gpu) over more and larger random shapes."""
import pytest
import torch

from nanovllm.attention.torch_backend import context_slots, decode_reference, prefill_reference, store_kv_reference
from nanovllm.kernels.kv_store import store_kv
from nanovllm.kernels.paged_attention import paged_decode, paged_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged_cache(seq_lens, page, kv_heads, head_dim, dtype, g):
    """A NaN-poisoned cache whose first seq_len slots of each sequence hold random K/V in scattered blocks."""
    blocks_needed = [-(-n // page) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    k_cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks_needed) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        tables[i, :blocks_needed[i]] = perm[used:used + blocks_needed[i]]
        used += blocks_needed[i]
        slots = tables[i, torch.arange(n) // page].long() * page + torch.arange(n) % page
        k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE)


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)


CASES_CPU = [  # (seq_lens, page, heads, kv_heads, head_dim)
    ([1, 17, 40], 16, 4, 2, 64),
    ([16, 33], 8, 8, 1, 32),
    ([5], 16, 2, 2, 80),
]
CASES_GPU = CASES_CPU + [
    ([1, 15, 16, 17, 255, 256, 257, 1500], 16, 32, 8, 128),
    ([4097, 3, 900], 16, 16, 8, 128),
    ([64, 100, 2000], 32, 14, 2, 64),
    ([300] * 40, 16, 28, 4, 128),
]
CASES = CASES_GPU if DEVICE == "cuda" else CASES_CPU
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_matches_reference(case, dtype, num_splits):
    seq_lens, page, heads, kv_heads, head_dim = case
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = _paged_cache(seq_lens, page, kv_heads, head_dim, dtype, g)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, num_splits, out=out)
    want = decode_reference(q.float(), k_cache.float(), v_cache.float(),
                            *context_slots(tables, lens, max(seq_lens), page), head_dim ** -0.5)
    torch.testing.assert_close(out.float(), want, **_tol(dtype))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_prefill_with_cached_prefix_matches_reference(case, dtype):
    seq_lens, page, heads, kv_heads, head_dim = case
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables = _paged_cache(seq_lens, page, kv_heads, head_dim, dtype, g)
    q_lens = [max(1, n // (i + 1)) for i, n in enumerate(seq_lens)]  # whole prompts, and chunks after a prefix
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, generator=g).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                  torch.tensor(starts, dtype=torch.int32, device=DEVICE), max(q_lens), head_dim ** -0.5, out=out)
    for i, n in enumerate(seq_lens):
        s, e = starts[i], starts[i + 1]
        want = prefill_reference(q[s:e].float(), None, None, k_cache.float(), v_cache.float(), tables[i], n,
                                 head_dim ** -0.5) if e - s < n else None
        if want is None:  # no prefix: the reference takes the new k/v, which are the cache's first n slots
            from nanovllm.attention.torch_backend import gather_context
            kk, vv = (gather_context(c.float(), tables[i], n) for c in (k_cache, v_cache))
            want = prefill_reference(q[s:e].float(), kk, vv, None, None, None, n, head_dim ** -0.5)
        torch.testing.assert_close(out[s:e].float(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    blocks, page, kv_heads, head_dim, tokens = 10, 16, 2, 64, 37
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    k = qkv[:, 4 * head_dim:(4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)  # strided views, as in the model
    v = qkv[:, (4 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * page, generator=g)[:tokens].to(DEVICE)
    caches = [torch.zeros(blocks, page, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_reference(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("vocab", [300, 4099] if DEVICE == "cpu" else [300, 4099, 151936])
def test_gumbel_argmax_matches_reference(vocab):
    from nanovllm.kernels.sampling import gumbel_argmax
    from nanovllm.layers.sampler import gumbel_argmax_reference

    g = torch.Generator().manual_seed(4)
    rows = 5 if DEVICE == "cpu" else 64
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(DEVICE)
    logits[0, vocab // 2:] = float("-inf")  # filtered tokens are never drawn
    seeds = torch.randint(0, 1 << 32, (rows,), generator=g).to(DEVICE)
    steps = torch.randint(0, 5000, (rows,), generator=g).to(DEVICE)
    got = gumbel_argmax(logits, seeds, steps)
    assert got.tolist() == gumbel_argmax_reference(logits, seeds, steps).tolist()
    assert got[0] < vocab // 2
