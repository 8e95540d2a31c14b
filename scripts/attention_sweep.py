"""The paged decode kernel alone against HBM bandwidth, over launch configs and cache layouts.
usage: python scripts/attention_sweep.py [num_seqs] [max_context] [configs|splits] [splits for configs, 4]
       python scripts/attention_sweep.py bench [step ...]
configs: block and launch sizes at one split count, cache layouts and page sizes; splits: the shipped config over
split counts, beside the count decode_num_splits picks for this batch. bench: the shipped kernel at bench.py's own
decode batches (its workload's sequences still running at each decode step, longest first, pages handed out in
order as they grow), as the engine calls it (Qwen3's q/k norms and rotary by the rotary kernel, then the decode
kernel storing the step's K/V) and the decode kernel alone over a cache that already holds them."""
import itertools
import random
import sys

import torch
from gpu_timing import copies_needed, graph_time

sys.path.insert(0, ".")
from bench import measure_hbm_bandwidth  # noqa: E402
from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode  # noqa: E402


def bench_tables(step: int, page: int = 16):
    """Context lengths and block table of bench.py's sequences still decoding at decode step `step`: prompts'
    pages first, in order, then a new page each time a sequence crosses a page boundary (blocks freed by finished
    sequences are not reused here, as they are in the engine)."""
    from types import SimpleNamespace

    from bench import make_workload
    prompts, out_lens = make_workload(SimpleNamespace(seed=0, num_seqs=256, input_len=(100, 1024),
                                                      output_len=(100, 1024)), 151936)
    lens = [len(p) for p in prompts]
    pages, taken = [], 0
    for n in lens:
        pages.append(list(range(taken, taken + -(-n // page))))
        taken += -(-n // page)
    for s in range(1, step + 1):
        for i, n in enumerate(lens):
            if out_lens[i] >= s and (n + s - 1) % page == 0:
                pages[i].append(taken)
                taken += 1
    alive = sorted((i for i in range(len(lens)) if out_lens[i] > step), key=lambda i: -lens[i])
    table = torch.zeros(len(alive), max(len(pages[i]) for i in alive), dtype=torch.int32)
    for r, i in enumerate(alive):
        table[r, :len(pages[i])] = torch.tensor(pages[i])
    return [lens[i] + step for i in alive], table.cuda(), taken


def bench_steps(steps: list[int], kv_heads: int = 8, group: int = 2, head_dim: int = 128, page: int = 16):
    from nanovllm.kernels.rotary import rotary_
    from nanovllm.layers.rotary_embedding import RotaryEmbedding

    bw = measure_hbm_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: bench.py's decode batches, Qwen3-0.6B attention, copy bandwidth "
          f"{bw / 1e12:.2f} TB/s\n| step | seqs | mean context | splits | GB a layer | rotary + decode as the engine calls "
          "them, us | of copy bw | decode alone, K/V stored before, us | of copy bw |\n|---|---|---|---|---|---|---|---|---|")
    rotary = RotaryEmbedding(head_dim, 40960, {"rope_type": "default", "rope_theta": 1e6}).cuda()
    cos, sin = rotary.tables(torch.bfloat16)
    norm = torch.ones(head_dim, dtype=torch.bfloat16, device="cuda")
    for step in steps:
        lens, table, blocks = bench_tables(step, page)
        B, kv_bytes = len(lens), sum(lens) * kv_heads * head_dim * 2 * 2
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        qkv = torch.randn(B, (group + 2) * kv_heads * head_dim, dtype=torch.bfloat16, device="cuda")
        q, k, v = qkv.split([group * kv_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k, v = q.view(B, -1, head_dim), k.view(B, kv_heads, head_dim), v.view(B, kv_heads, head_dim)
        last = seq_lens.long() - 1
        slots = table[torch.arange(B, device="cuda"), last // page].long() * page + last % page
        caches = [tuple(torch.randn(blocks, page, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2)) for _ in range(copies_needed(kv_bytes))]
        splits = decode_num_splits(B, kv_heads, 2048, sms)

        def engine_call(kc, vc):
            rotary_(last, q, k, cos, sin, norm, norm, 1e-6)  # q, k rotated again each call: timing only
            return paged_decode(q, kc, vc, table, seq_lens, head_dim ** -0.5, splits, new_kv=(k, v, slots))

        engine = graph_time([lambda kc=kc, vc=vc: engine_call(kc, vc) for kc, vc in caches])
        q_flat = q.contiguous()
        plain = graph_time([lambda kc=kc, vc=vc: paged_decode(q_flat, kc, vc, table, seq_lens, head_dim ** -0.5, splits)
                            for kc, vc in caches])
        print(f"| {step} | {B} | {sum(lens) / B:.0f} | {splits} | {kv_bytes / 1e9:.3f} | {engine * 1e6:.1f} "
              f"| {kv_bytes / engine / bw:.0%} | {plain * 1e6:.1f} | {kv_bytes / plain / bw:.0%} |")
        del caches


if len(sys.argv) > 1 and sys.argv[1] == "bench":
    bench_steps([int(a) for a in sys.argv[2:]] or [200, 500, 850, 950])
    sys.exit(0)
num_seqs = int(sys.argv[1]) if len(sys.argv) > 1 else 256
max_context = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
mode = sys.argv[3] if len(sys.argv) > 3 else "configs"
config_splits = int(sys.argv[4]) if len(sys.argv) > 4 else 4
KV_HEADS, GROUP, HEAD_DIM = 8, 2, 128  # Qwen3-0.6B
rng = random.Random(0)
lens = [rng.randint(100, max_context) for _ in range(num_seqs)]
kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * 2


def make_cache(page, layout):
    """A shuffled block table over a cache of [blocks, page, kv_heads, dim] (NHD) or a view of one stored
    [blocks, kv_heads, page, dim] (HND); the kernel reads either through its strides."""
    per_seq = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(per_seq), generator=torch.Generator().manual_seed(0))
    table = torch.zeros(num_seqs, max(per_seq), dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = perm[at:at + n]
        at += n
    shape = (sum(per_seq), page, KV_HEADS, HEAD_DIM) if layout == "NHD" else (sum(per_seq), KV_HEADS, page, HEAD_DIM)
    k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v, table.cuda()


q = torch.randn(num_seqs, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
scale = HEAD_DIM ** -0.5
bw = measure_hbm_bandwidth()
print(f"{torch.cuda.get_device_name()}: {num_seqs} seqs, context U[100, {max_context}], "
      f"{kv_bytes / 1e9:.2f} GB of K+V a layer, copy bandwidth {bw / 1e12:.2f} TB/s")
print("| layout | page | block_n | warps | stages | splits | us | TB/s | of copy bw | max err |")
print("|---|---|---|---|---|---|---|---|---|---|")
caches = {}
reference = None


def run(layout, page, block_n, warps, stages, splits):
    """Time one config over enough copies of the cache that no call finds its K/V in L2."""
    global reference
    if (page, layout) not in caches:
        caches.clear()
        caches[page, layout] = [make_cache(page, layout) for _ in range(copies_needed(kv_bytes))]
    launch = dict(block_n=block_n, num_warps=warps, num_stages=stages)
    calls = [lambda k=k, v=v, t=t: paged_decode(q, k, v, t, seq_lens, scale, splits, **launch)
             for k, v, t in caches[page, layout]]
    try:
        out = calls[0]()
        seconds = graph_time(calls)
    except Exception as e:  # out of shared memory and the like
        print(f"| {layout} | {page} | {block_n} | {warps} | {stages} | {splits} | failed: {type(e).__name__} |")
        return None
    if reference is None or reference[0] != (page, layout):
        reference = ((page, layout), out)
    err = (out.float() - reference[1].float()).abs().max().item()
    print(f"| {layout} | {page} | {block_n} | {warps} | {stages} | {splits} | {seconds * 1e6:.1f} "
          f"| {kv_bytes / seconds / 1e12:.2f} | {kv_bytes / seconds / bw:.0%} | {err:.1e} |")
    return seconds


if mode == "splits":
    picked = decode_num_splits(num_seqs, KV_HEADS, max_context, torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"decode_num_splits picks {picked}")
    for splits in (1, 2, 4, 8, 16, 32, 64):
        run("NHD", 16, 64, 4, None, splits)
else:
    run("NHD", 16, 64, 4, None, config_splits)
    best = min(((run("NHD", 16, bn, w, st, config_splits) or 1e9), bn, w, st or 0)
               for bn, w, st in itertools.product((32, 64, 128), (4, 8), (None, 2, 3, 4)))
    _, bn, w, st = best
    st = st or None
    print(f"best at {config_splits} splits: block_n {bn}, warps {w}, stages {st}")
    for layout, page, splits in itertools.product(("NHD", "HND"), (16, 64), (1, 2, 4, 8)):
        run(layout, page, bn, w, st, splits)
