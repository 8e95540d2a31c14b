"""The CUDA decode attention for few sequences (csrc/paged_decode_cluster.cu) against the torch reference on the
GPU: the rotary twin at each sequence's last position, then decode_reference over the cache holding the step's
rotated key; in a CUDA graph between one-row GEMVs under PDL, replays as eager runs. On CPU: off, saying why.
tests/test_cuda_library.py builds its source."""
import pytest
import torch
from helpers import kernel_tol
from test_triton_kernels import _paged_cache, _rotary_and_norms

from nanovllm.attention.torch_backend import context_slots, decode_reference
from nanovllm.kernels import paged_decode_cluster as cluster
from nanovllm.kernels.attention_inputs import DecodeRope

CASES = [  # (seq_lens, page, heads, kv_heads, head_dim)
    ([1], 16, 16, 8, 128),
    ([7], 16, 2, 2, 64),            # one query head a kv head
    ([640], 16, 16, 8, 128),        # Qwen3-0.6B at bench.py's decode1 length
    ([1000], 16, 32, 8, 128),       # Llama-3-8B's group of 4
    ([129], 32, 64, 8, 128),        # a group of 8, 32-token pages
    ([3000], 16, 16, 8, 128),       # 375 positions a split: three rounds of 128
    ([17, 300, 1], 16, 8, 2, 64),   # several sequences
    ([300, 5], 256, 16, 8, 128),    # 256-token pages
]


def _decode_step(case, dtype, qk_norm, seed):
    """A cache with each sequence's last slot NaN, the fused qkv rows of the step, the reference output, the
    rotated keys the cache must receive, and the kernel's arguments."""
    seq_lens, page, heads, kv_heads, head_dim = case
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(seq_lens, page, kv_heads, head_dim, dtype, g)
    rope, norms = _rotary_and_norms(head_dim, 4096, dtype, qk_norm, g)
    B = len(seq_lens)
    qkv = torch.randn(B, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).cuda()
    q = qkv[:, :heads * head_dim].view(B, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(B, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(B, kv_heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    last = lens.long() - 1
    slots = tables[torch.arange(B, device="cuda"), last // page].long() * page + last % page
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    flat_k[slots], flat_v[slots] = float("nan"), float("nan")
    want_q, want_k = rope.forward_native(last, q, k, *norms)
    ref_k, ref_v = k_cache.float(), v_cache.float()
    ref_k.view(-1, kv_heads, head_dim)[slots], ref_v.view(-1, kv_heads, head_dim)[slots] = want_k.float(), v.float()
    want = decode_reference(want_q.float(), ref_k, ref_v, *context_slots(tables, lens, max(seq_lens), page),
                            head_dim ** -0.5)
    cos, sin = rope.tables(dtype)
    fused = DecodeRope(cos, sin, norms[0].weight if qk_norm else None, norms[1].weight if qk_norm else None, 1e-6)
    args = (q, k, v, k_cache, v_cache, tables, lens, slots, head_dim ** -0.5, fused)
    return args, want, want_k, slots


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("cap", [128, 16])  # 16: most splits take several rounds
@pytest.mark.parametrize("splits", [8, 16])
def test_matches_rotary_then_reference(case, dtype, qk_norm, cap, splits, monkeypatch):
    monkeypatch.setattr(cluster, "MAX_SEQS", len(case[0]))
    args, want, want_k, slots = _decode_step(case, dtype, qk_norm, seed=5)
    k_cache, v_cache = args[3], args[4]
    before = (k_cache.clone(), v_cache.clone())
    out = torch.full_like(args[0], float("nan"))
    got = cluster.paged_decode_cluster(*args, splits=splits, cap=cap, out=out)
    assert got is out
    torch.testing.assert_close(got.float(), want, **kernel_tol(dtype))
    kv_heads, head_dim = k_cache.shape[2:]
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim)[slots].float(), want_k.float(), atol=1e-2 if
                               dtype == torch.bfloat16 else 1e-3, rtol=0)  # q/k norms: 1 / sqrt vs rsqrt
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], args[2])
    for cache, old in zip((k_cache, v_cache), before):  # nothing else written
        old.view(-1, kv_heads, head_dim)[slots] = cache.view(-1, kv_heads, head_dim)[slots]
        assert torch.equal(cache.nan_to_num(7.0), old.nan_to_num(7.0))
    assert torch.equal(cluster.paged_decode_cluster(*args, splits=splits, cap=cap), got)  # deterministic


@pytest.mark.gpu
def test_in_a_graph_between_one_row_gemvs_replays_as_eager(monkeypatch):
    """qkv GEMV -> this kernel -> o GEMV, captured under PDL and replayed with new inputs each time: every replay
    equals the eager chain on the same inputs (a read of q/k/v before the GEMV wrote them would show here)."""
    from nanovllm.kernels.gemv_one_row import gemv_one_row

    case = ([640], 16, 16, 8, 128)
    args, _, _, _ = _decode_step(case, torch.bfloat16, True, seed=8)
    q, k, v, k_cache, v_cache, tables, lens, slots, scale, rope = args
    hidden = 1024
    g = torch.Generator().manual_seed(9)
    w_qkv = (torch.randn(32 * 128, hidden, generator=g) * 0.03).to(torch.bfloat16).cuda()
    w_o = (torch.randn(hidden, 16 * 128, generator=g) * 0.03).to(torch.bfloat16).cuda()
    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device="cuda")
    qkv = torch.empty(1, 32 * 128, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(1, hidden, dtype=torch.bfloat16, device="cuda")

    def chain():
        gemv_one_row(x, w_qkv, out=qkv)
        views = (qkv[:, :2048].view(1, 16, 128), qkv[:, 2048:3072].view(1, 8, 128), qkv[:, 3072:].view(1, 8, 128))
        attn = cluster.paged_decode_cluster(*views, k_cache, v_cache, tables, lens, slots, scale, rope, splits=16,
                                            cap=128)
        gemv_one_row(attn.view(1, -1), w_o, out=y)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for i in range(30):
        x.copy_(torch.randn(1, hidden, generator=g).to(torch.bfloat16))
        graph.replay()
        replayed = y.clone()
        chain()
        assert torch.equal(replayed, y), f"replay {i} differs from eager"


def test_capacity_and_dispatch_rules():
    assert cluster.capacity(1024, 8) == 128 and cluster.capacity(100, 8) == 16
    assert cluster.capacity(40960, 16) == cluster.MAX_CAP
    cpu = torch.device("cpu")
    assert cluster.plan(1, 2048, cpu) == (16, 128) and cluster.plan(1, 2049, cpu) is None
    assert cluster.plan(4, 1024, cpu) == (8, 128) and cluster.plan(2, 1025, cpu) is None
    assert cluster.plan(5, 512, cpu) is None
    q = torch.empty(1, 16, 128, dtype=torch.bfloat16)
    cache = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
    assert not cluster.takes(q, cache, 1)  # no GPU here, or not this dtype
    assert cluster.why_off(torch.device("cpu")) == "no CUDA GPU"


def test_context_bounds_plan_short_contexts_whatever_max_model_len():
    """Decode steps are planned for the smallest bound that holds their contexts: the kernel's one-round plans up to
    what a cluster holds, then max_model_len (the Triton kernels)."""
    cpu = torch.device("cpu")
    assert cluster.context_bounds(1, 40960, cpu) == [256, 512, 1024, 2048, 40960]
    assert cluster.context_bounds(4, 40960, cpu) == [256, 512, 1024, 40960]
    assert cluster.context_bounds(1, 700, cpu) == [256, 512, 700]
    assert cluster.context_bounds(5, 40960, cpu) == [40960]
    for seqs in (1, 2, 4):
        *short, longest = cluster.context_bounds(seqs, 40960, cpu)
        for bound in short:
            splits, cap = cluster.plan(seqs, bound, cpu)
            assert splits * cap >= bound and cap == cluster.capacity(bound, splits)
        assert cluster.plan(seqs, longest, cpu) is None


def test_a_step_takes_the_smallest_bound_that_holds_its_longest_context():
    from nanovllm.attention.backend import decode_context_bound
    from nanovllm.attention.metadata import AttentionMetadata

    class Backend:
        def decode_context_bounds(self, num_seqs, max_model_len):
            return cluster.context_bounds(num_seqs, max_model_len, torch.device("cpu"))

    for longest, bound in ((1, 256), (256, 256), (257, 512), (2048, 2048), (2049, 40960), (40960, 40960)):
        meta = AttentionMetadata(slot_mapping=None, query_start_loc=None, seq_lens=torch.ones(1), block_tables=None,
                                 num_decodes=1, max_query_len=1, max_seq_len=longest, query_start_loc_cpu=None,
                                 seq_lens_cpu=None)
        assert decode_context_bound(Backend(), meta, 40960) == bound
