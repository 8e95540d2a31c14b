"""Triton kernels against their torch references: on CPU under TRITON_INTERPRET=1 at tiny sizes (set by
conftest), on the GPU (marked gpu) over more and larger random shapes."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers import kernel_tol

from nanovllm.attention.torch_backend import context_slots, decode_reference, prefill_reference, store_kv_reference
from nanovllm.engine.cuda_graph import graph_batch_sizes, max_prefill_tiles, prefill_graph_sizes
from nanovllm.kernels import decode_inputs
from nanovllm.kernels.attention_inputs import prefill_tile_tokens, prefill_tiles
from nanovllm.kernels.gemv import gemv, gemv_reference
from nanovllm.kernels.kv_store import store_kv
from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode, paged_prefill
from nanovllm.kernels.rounding import round_to
from nanovllm.kernels.sampling import _log_exponential

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
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]  # the interpreter truncates bf16


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 4, 16])  # 1-2 splits: a kv-head-major grid
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
    torch.testing.assert_close(out.float(), want, **kernel_tol(dtype))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])  # one split writes the output itself; several merge partials
def test_paged_decode_storing_the_new_token_matches_store_then_decode(case, dtype, num_splits):
    """The decode kernel that takes this step's key and value from its inputs (their slot still NaN) and writes
    them to the cache: the output of storing first (up to the order the new token is folded in), the same cache."""
    seq_lens, page, heads, kv_heads, head_dim = case
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = _paged_cache(seq_lens, page, kv_heads, head_dim, dtype, g)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = decode_reference(q.float(), k_cache.float(), v_cache.float(),
                            *context_slots(tables, lens, max(seq_lens), page), head_dim ** -0.5)
    last = lens.long() - 1
    slots = tables[torch.arange(len(seq_lens), device=DEVICE), last // page].long() * page + last % page
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    qkv = torch.cat([flat_k[slots], flat_v[slots], flat_k[slots]], dim=1)  # strided rows, as views of a fused qkv
    k_new, v_new = qkv[:, :kv_heads], qkv[:, kv_heads:2 * kv_heads]
    cache_before = (k_cache.clone(), v_cache.clone())
    flat_k[slots], flat_v[slots] = float("nan"), float("nan")
    got = paged_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, num_splits, new_kv=(k_new, v_new, slots))
    torch.testing.assert_close(got.float(), want, **kernel_tol(dtype))
    assert torch.equal(k_cache.nan_to_num(7.0), cache_before[0].nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), cache_before[1].nan_to_num(7.0))


def _rotary_and_norms(head_dim, max_position, dtype, qk_norm, g):
    """A rotary embedding and Qwen3's q/k norms with random weights near 1 ([None, None] without norms)."""
    from nanovllm.layers.layernorm import RMSNorm
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, max_position, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    norms = [None, None]
    if qk_norm:
        norms = [RMSNorm(head_dim, 1e-6).to(DEVICE).to(dtype) for _ in range(2)]
        for norm in norms:
            norm.weight.data = (1 + torch.randn(head_dim, generator=g) * 0.1).to(dtype).to(DEVICE)
    return rope, norms


def _step(new, heads, kv_heads, head_dim, g, seq_lens=(1, 17, 40), page=16):
    """A step's metadata (`new` tokens per sequence, seq_lens the context after it) and a cache whose slots for
    the step's tokens are NaN (not written yet)."""
    from nanovllm.attention.metadata import AttentionMetadata

    seq_lens = list(seq_lens)
    k_cache, v_cache, tables = _paged_cache(seq_lens, page, kv_heads, head_dim, torch.float32, g)
    slots = torch.cat([tables[i, torch.arange(n - m, n, device=DEVICE) // page].long() * page
                       + torch.arange(n - m, n, device=DEVICE) % page for i, (n, m) in enumerate(zip(seq_lens, new))])
    k_cache.view(-1, kv_heads, head_dim)[slots] = float("nan")
    v_cache.view(-1, kv_heads, head_dim)[slots] = float("nan")
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    num_decodes = next((i for i, m in enumerate(new) if m != 1), len(new))
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=tables,
        num_decodes=num_decodes, max_query_len=max(new), max_seq_len=max(seq_lens), query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        prefill_tiles=torch.from_numpy(prefill_tiles(new, prefill_tile_tokens(heads // kv_heads))).to(DEVICE))
    return meta, k_cache, v_cache


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_triton_backend_matches_torch_backend(step):
    """The backends behind one interface: same outputs and the same cache after a decode step (whose kernel
    stores the new keys and values itself) and after a prefill step over a cached prefix (store, then attend)."""
    from nanovllm.attention.torch_backend import TorchAttentionBackend
    from nanovllm.attention.triton_backend import TritonAttentionBackend

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim = 4, 2, 64
    new = [1, 1, 1] if step == "decode" else [1, 9, 23]
    meta, k_cache, v_cache = _step(new, heads, kv_heads, head_dim, g)
    T = sum(new)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(T, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim)
    caches = (k_cache.clone(), v_cache.clone())
    want = TorchAttentionBackend().forward(q, k, v, caches[0], caches[1], meta, head_dim ** -0.5)
    got = TritonAttentionBackend(2048, torch.device(DEVICE)).forward(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(got, want, **kernel_tol(torch.float32))
    assert torch.equal(k_cache.nan_to_num(7.0), caches[0].nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), caches[1].nan_to_num(7.0))


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_qwen3_attention_on_triton_matches_torch_backend(step):
    """Qwen3's attention layer: on decode steps the Triton backend takes q and k unrotated and applies the q/k
    norms and rotary itself (the CUDA kernel of few sequences, else the rotary kernel before the decode kernel; the
    layer's rotary is skipped); output and cache as the torch backend after the rotary twin."""
    from transformers import Qwen3Config

    from nanovllm.attention.torch_backend import TorchAttentionBackend
    from nanovllm.attention.triton_backend import TritonAttentionBackend
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    from nanovllm.models.llama import LlamaAttention
    from nanovllm.rope_scaling import rope_parameters

    config = Qwen3Config(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=256)
    g = torch.Generator().manual_seed(9)
    rotary = RotaryEmbedding(32, 256, rope_parameters(config))
    layer = LlamaAttention(config, rotary, qkv_bias=False, o_bias=False, qk_norm=True).to(DEVICE)
    for param in layer.parameters():
        param.data = (torch.randn(param.shape, generator=g) * 0.2 + (1 if param.dim() == 1 else 0)).to(DEVICE)
    new = [1, 1, 1] if step == "decode" else [1, 9, 23]
    meta, k_cache, v_cache = _step(new, 4, 2, 32, g)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(meta.seq_lens_cpu, new)]).to(DEVICE)
    qkv = torch.randn(sum(new), (4 + 2 * 2) * 32, generator=g).to(DEVICE)
    outputs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(2048, torch.device(DEVICE))):
        layer.attn.backend, layer.attn.k_cache, layer.attn.v_cache = backend, k_cache.clone(), v_cache.clone()
        assert layer.attn.rotates_in_kernel(meta) == (backend.rotates_decode and step == "decode")
        outputs.append(layer(positions, qkv.clone(), meta))
        caches.append((layer.attn.k_cache, layer.attn.v_cache))
    torch.testing.assert_close(outputs[1], outputs[0], **kernel_tol(torch.float32))
    for got, want in zip(caches[1], caches[0]):
        torch.testing.assert_close(got.nan_to_num(7.0), want.nan_to_num(7.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_tokens", [256, 1000, 8192, 16384])
def test_prefill_graph_buckets_hold_every_batch(max_tokens):
    """Any step of up to max_tokens tokens finds a token bucket, and its tile list fits the room that bucket's
    graph captured."""
    sizes = prefill_graph_sizes(max_tokens)
    assert sizes[-1] == max_tokens and sizes == sorted(set(sizes))
    rng = np.random.default_rng(0)
    for _ in range(300):
        num_seqs = int(rng.integers(1, 257))
        lens = rng.integers(1, max(2, 2 * max_tokens // num_seqs), num_seqs)
        lens = lens[np.cumsum(lens) <= max_tokens]
        if len(lens) == 0:
            continue
        bucket = next(t for t in sizes if t >= lens.sum())
        for tile_tokens in (1, 8, 64):
            assert prefill_tiles(lens, tile_tokens).shape[1] <= max_prefill_tiles(bucket, 256, tile_tokens)


@pytest.mark.parametrize("max_batch", [1, 5, 100, 256, 512])
def test_decode_splits_agree_between_a_batch_and_its_graph_bucket(max_batch):
    """An eager step and the CUDA graph that would serve the same batch must split contexts alike."""
    buckets = graph_batch_sizes(max_batch)
    for num_seqs in range(1, max_batch + 1):
        bucket = next(b for b in buckets if b >= num_seqs)
        for kv_heads, max_len, sms in [(8, 2048, 132), (2, 40960, 132), (1, 128, 4)]:
            assert decode_num_splits(num_seqs, kv_heads, max_len, sms) == decode_num_splits(bucket, kv_heads, max_len, sms)
    assert decode_num_splits(1, 8, 40960, 132) > decode_num_splits(256, 8, 40960, 132) == 1


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
    tile_tokens = prefill_tile_tokens(heads // kv_heads)
    tiles = np.full((2, prefill_tiles(q_lens, tile_tokens).shape[1] + 5), -1, dtype=np.int32)  # spare entries, as a graph's
    tiles[:, :-5] = prefill_tiles(q_lens, tile_tokens)
    paged_prefill(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                  torch.tensor(starts, dtype=torch.int32, device=DEVICE), torch.from_numpy(tiles).to(DEVICE),
                  head_dim ** -0.5, out=out)
    for i, n in enumerate(seq_lens):
        s, e = starts[i], starts[i + 1]
        want = prefill_reference(q[s:e].float(), None, None, k_cache.float(), v_cache.float(), tables[i], n,
                                 head_dim ** -0.5) if e - s < n else None
        if want is None:  # no prefix: the reference takes the new k/v, which are the cache's first n slots
            from nanovllm.attention.torch_backend import gather_context
            kk, vv = (gather_context(c.float(), tables[i], n) for c in (k_cache, v_cache))
            want = prefill_reference(q[s:e].float(), kk, vv, None, None, None, n, head_dim ** -0.5)
        torch.testing.assert_close(out[s:e].float(), want, **kernel_tol(dtype))


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


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, round_to(tl.load(x_ptr + offs, mask=offs < n), DTYPE), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy cast of 3.4e38 to fp16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_matches_torch_casts(dtype):
    g = torch.Generator().manual_seed(6)
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-40, 70000.0])
    bf16_ties = (torch.arange(64, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)  # exactly halfway
    nan_payload = torch.tensor([0x7F800001, 0xFF800001], dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([torch.randn(500, generator=g) * 10 ** torch.randint(-8, 8, (500,), generator=g), special,
                   bf16_ties, nan_payload]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, x.numel(), DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16,
                        BLOCK=triton.next_power_of_2(x.numel()))
    torch.testing.assert_close(out, x.to(dtype).float(), rtol=0, atol=0, equal_nan=True)


GEMV_SHAPES = [(1, 40, 96), (3, 33, 300), (16, 64, 1024), (24, 40, 96)] + ([] if DEVICE == "cpu" else [
    (1, 4096, 1024), (7, 1024, 3072), (40, 6144, 1024), (64, 1024, 3072), (64, 151936, 1024)])


@pytest.mark.parametrize("rows,n,k", GEMV_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(rows, n, k, dtype, bias):
    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*shape, generator=g).to(dtype).to(DEVICE) for shape in ((rows, k), (n, k), (n,)))
    b = b if bias else None
    want = gemv_reference(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(gemv(x, w, b).float(), want, **kernel_tol(dtype))
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=DEVICE)  # a CUDA graph's static output
    assert gemv(x, w, b, out=out) is out and torch.equal(out, gemv(x, w, b))
    tiles = dict(block_n=16, block_k=64, num_stages=2, num_warps=4)  # K and N tails that the default tiles cover
    torch.testing.assert_close(gemv(x, w, b, **tiles).float(), want, **kernel_tol(dtype))


@pytest.mark.parametrize("rows,n,k", GEMV_SHAPES[:3] + GEMV_SHAPES[5:7])
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_gemv_of_a_per_channel_quantized_weight(rows, n, k, qdtype):
    """int8 / fp8 weights with one fp32 scale a row (quantization='int8' / 'fp8'): the GEMV converts W to x's dtype
    (exactly) and scales its fp32 sums."""
    from nanovllm.quant.quantize import dequantize_per_channel, quantize_per_channel

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(6)
    q, scale = (t.to(DEVICE) for t in quantize_per_channel(torch.randn(n, k, generator=g), qdtype))
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    want = gemv_reference(x.float(), dequantize_per_channel(q, scale))
    torch.testing.assert_close(gemv(x, q, scale=scale).float(), want, **kernel_tol(dtype))


@pytest.mark.parametrize("vocab", [300, 4099] if DEVICE == "cpu" else [300, 4099, 151936])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_gumbel_argmax_matches_reference(vocab, num_splits):
    """Every split count draws the reference's tokens: the splits' best scores merge to the row's first argmax."""
    from nanovllm.kernels.sampling import _row_counters, gumbel_argmax
    from nanovllm.layers.sampler import gumbel_argmax_reference

    g = torch.Generator().manual_seed(4)
    rows = 5 if DEVICE == "cpu" else 64
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(DEVICE)
    logits[0, vocab // 2:] = float("-inf")  # filtered tokens are never drawn
    logits[1, :-1] = float("-inf")  # only the last token, in the last split, is left
    seeds = torch.randint(0, 1 << 32, (rows,), generator=g).to(DEVICE)
    steps = torch.randint(0, 5000, (rows,), generator=g).to(DEVICE)
    got = gumbel_argmax(logits, seeds, steps, num_splits=num_splits)
    assert got.tolist() == gumbel_argmax_reference(logits, seeds, steps).tolist()
    assert got[0] < vocab // 2 and got[1] == vocab - 1
    # the rows' last splits left their counters at zero: a second draw merges as the first
    assert torch.equal(gumbel_argmax(logits, seeds, steps, num_splits=num_splits), got)
    assert not _row_counters(rows, logits.device).any()


def test_gumbel_argmax_never_draws_an_improbable_token():
    """The draw whose noise is the largest possible (seed 2615, step 0, token 3923) stays finite: the token with
    all the probability wins, with or without a temperature."""
    from nanovllm.kernels.sampling import gumbel_argmax

    logits = torch.zeros(2, 4096, device=DEVICE)
    logits[:, 0] = 30.0
    seeds, steps = torch.full((2,), 2615, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    assert gumbel_argmax(logits, seeds, steps).tolist() == [0, 0]
    assert gumbel_argmax(logits, seeds, steps, torch.ones(2, device=DEVICE)).tolist() == [0, 0]


@triton.jit
def _log_exponential_probe(bits_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, _log_exponential(bits, FAST), mask=offs < n)


def test_log_exponential_matches_exact_logs():
    """log E of the sampling kernel at every uniform it can draw (on the GPU; a spread of them on CPU), against
    float64: compiled, with the hardware lg2 and the series near u = 1, within 4e-6 (the bound its docstring gives)."""
    k = torch.arange(1 << 23, dtype=torch.int64)
    if DEVICE == "cpu":
        k = torch.cat([k[:256], k[(1 << 22) - 128:(1 << 22) + 128], k[-(1 << 19) - 128:-(1 << 19) + 128], k[-256:]])
    exact = torch.log(-torch.log((k.double() + 0.5) / (1 << 23)))
    bits = (k << 9).to(torch.int32 if DEVICE == "cpu" else torch.int64).to(DEVICE)
    out = torch.empty(k.shape[0], dtype=torch.float32, device=DEVICE)
    _log_exponential_probe[(triton.cdiv(k.shape[0], 1024),)](bits, out, k.shape[0], FAST=DEVICE == "cuda", BLOCK=1024)
    assert (out.double().cpu() - exact).abs().max() < 4e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gumbel_argmax_with_temperature_matches_reference(dtype):
    """The fused pass: logits in the model's dtype, divided by each row's temperature; rows at 0 are greedy."""
    from nanovllm.kernels.sampling import _block, gumbel_argmax
    from nanovllm.layers.sampler import gumbel_argmax_reference

    g = torch.Generator().manual_seed(5)
    rows, vocab = (6, 1000) if DEVICE == "cpu" else (256, 151936)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(DEVICE)
    seeds = torch.randint(0, 1 << 32, (rows,), generator=g).to(DEVICE)
    steps = torch.randint(0, 5000, (rows,), generator=g).to(DEVICE)
    temperature = torch.rand(rows, generator=g).to(DEVICE) * 1.5
    temperature[::3] = 0
    logits[3] = 0  # a greedy row of ties: the first maximum wins, though a later one sits in an earlier lane
    logits[3, 200] = logits[3, _block() + 8] = 1
    got = gumbel_argmax(logits, seeds, steps, temperature)
    assert got.tolist() == gumbel_argmax_reference(logits, seeds, steps, temperature).tolist()
    assert got[::3].tolist() == logits[::3].float().argmax(-1).tolist() and got[3] == 200
    assert gumbel_argmax(logits[3:4], seeds[3:4], steps[3:4], temperature[3:4], num_splits=1).item() == 200
    hot = torch.full_like(temperature, 50.0)  # near-uniform draws: most rows leave the argmax
    assert (gumbel_argmax(logits, seeds, steps, hot) != logits.float().argmax(-1)).float().mean() > 0.5



def _exact_or_close(got, want, dtype):
    """bf16 results round where the twin rounds; only the fp32 sum order differs, which moves a rare last bit."""
    if dtype == torch.bfloat16:
        mismatch = (got != want).float().mean().item()
        assert mismatch < 0.02, f"{mismatch:.1%} of bf16 values differ from the torch twin"
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576] if DEVICE == "cpu" else [64, 576, 1024, 4096])
def test_rms_norm_with_residual_matches_twin(dtype, n):
    from nanovllm.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(n, 1e-6).to(DEVICE)
    norm.weight.data = (1 + torch.randn(n, generator=g) * 0.1).to(DEVICE)
    norm = norm.to(dtype)
    x = (torch.randn(7, n, generator=g) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(7, n, generator=g).to(dtype).to(DEVICE)
    want_out, want_res = norm.forward_native(x, residual)
    want_plain = norm.forward_native(x)
    got_plain = norm.forward_triton(x)
    got_out, got_res = norm.forward_triton(x, residual.clone())
    assert torch.equal(got_res, want_res)  # the residual sum rounds exactly as torch's add
    _exact_or_close(got_out, want_out, dtype)
    _exact_or_close(got_plain, want_plain, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1536] if DEVICE == "cpu" else [96, 1024, 2560, 4096])
def test_embedding_matches_twin(dtype, hidden):
    from nanovllm.layers.embed_head import VocabEmbedding

    g = torch.Generator().manual_seed(6)
    embed = VocabEmbedding(50, hidden)
    embed.weight.data = torch.randn(50, hidden, generator=g).to(dtype)
    embed = embed.to(DEVICE)
    ids = torch.tensor([[3, 49, 0, 3], [7, 7, 1, 48]]).to(DEVICE)  # repeats, both ends of the vocabulary
    assert torch.equal(embed.forward_triton(ids), embed.forward_native(ids))
    assert torch.equal(embed.forward_triton(ids[0, :1]), embed.forward_native(ids[0, :1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [96, 1536] if DEVICE == "cpu" else [96, 1536, 3072, 14336])
def test_silu_and_mul_matches_twin(dtype, d):
    from nanovllm.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 2 * d, generator=g) * 4).to(dtype).to(DEVICE)
    act = SiluAndMul()
    _exact_or_close(act.forward_triton(x), act.forward_native(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("shape", [(4, 2, 64), (3, 1, 80)] if DEVICE == "cpu" else [(4, 2, 64), (3, 1, 80), (32, 8, 128),
                                                                                     (16, 8, 128)])
def test_rotary_in_place_matches_twin(dtype, qk_norm, shape):
    heads, kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(7)
    rope, norms = _rotary_and_norms(head_dim, 4096, dtype, qk_norm, g)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # strided views of a fused qkv, as in the model
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    want_q, want_k = rope.forward_native(positions, q, k, *norms)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    got_q, got_k = rope.forward_triton(positions, q, k, *norms)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched
    _exact_or_close(got_q, want_q, dtype)
    _exact_or_close(got_k, want_k, dtype)


@pytest.mark.parametrize("value", ["abc", "-1", "65", ""])
def test_gemv_rows_setting_rejects_bad_values(value):
    from nanovllm.kernels.gemv import _gemv_rows

    with pytest.raises(ValueError, match="NANOVLLM_GEMV_ROWS"):
        _gemv_rows(value)
    assert _gemv_rows("0") == 0 and _gemv_rows("16") == 16 and _gemv_rows("64") == 64


@pytest.mark.parametrize("rows,num_rows", [(1, 1), (16, 5), (16, 0), (200, 131)])
def test_decode_inputs_match_reference(rows, num_rows):
    """A decode graph's first kernel (slots, context lengths, padding rows reset, the step counted and its token ring
    row picked; input embeddings gathered where given) and a sampling graph's last (tokens become input ids and go
    to that ring row, positions and steps + 1, padding rows untouched) against their torch references, over two
    steps of a 2-row ring."""
    g = torch.Generator().manual_seed(rows)
    block_size, width, scratch, ring_rows = 16, 8, 999, 2
    state = dict(positions=torch.randint(0, block_size * width, (rows,), generator=g),
                 seq_lens=torch.randint(0, 9, (rows,), generator=g).int(),
                 slot_mapping=torch.randint(0, 9, (rows,), generator=g),
                 block_tables=torch.randint(0, 500, (rows, width), generator=g).int(),
                 ring_state=torch.tensor([5, 0], dtype=torch.int32))
    ring_ref = torch.full((ring_rows, rows + 3), -1)
    ring_got = ring_ref.clone().pin_memory() if DEVICE == "cuda" else ring_ref.clone()  # as the graphs' ring
    ref = {k: v.clone() for k, v in state.items()}
    got = {k: v.to(DEVICE) for k, v in state.items()}
    table = torch.randn(1000, 40, generator=g)  # embedding rows gathered in the same launch on the second step
    for step in range(2):
        ids = torch.randint(0, 1000, (rows,), generator=g)
        embed = dict(input_ids=ids.to(DEVICE), embedding=table.to(DEVICE)) if step == 1 else {}
        embeds = decode_inputs.prepare_decode_inputs(
            **got, **embed, num_rows=torch.tensor([num_rows], dtype=torch.int32, device=DEVICE), scratch_block=scratch,
            block_size=block_size, ring_rows=ring_rows)
        embeds_ref = decode_inputs.prepare_decode_inputs_reference(
            **ref, **({"input_ids": ids, "embedding": table} if embed else {}), num_rows=num_rows,
            scratch_block=scratch, block_size=block_size, ring_rows=ring_rows)
        for key in state:
            assert torch.equal(got[key].cpu(), ref[key]), key
        assert (embeds is None and embeds_ref is None) if step == 0 else torch.equal(embeds.cpu(), embeds_ref)
        tokens = torch.randint(0, 1000, (rows,), generator=g)
        ids, steps = torch.randint(0, 1000, (rows,), generator=g), torch.randint(0, 1000, (rows,), generator=g)
        moved = [t.clone().to(DEVICE) for t in (tokens, ids, ref["positions"], steps)]
        decode_inputs.advance_decode_inputs(*moved, num_rows=torch.tensor([num_rows], dtype=torch.int32, device=DEVICE),
                                            ring=ring_got, ring_state=got["ring_state"])
        expected = [t.clone() for t in (tokens, ids, ref["positions"], steps)]
        decode_inputs.advance_decode_inputs_reference(*expected, num_rows=num_rows, ring=ring_ref,
                                                      ring_state=ref["ring_state"])
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(moved, expected))
        assert torch.equal(ring_got, ring_ref)
    assert ref["ring_state"].tolist() == [7, 0] and (ring_ref[:, :num_rows] >= 0).all()
