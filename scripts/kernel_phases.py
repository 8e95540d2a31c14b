"""Where the time of a bs=1 decode layer goes, phase by phase inside the CUDA kernels: builds copies of
csrc/gemv_one_row.cu and csrc/paged_decode_cluster.cu with globaltimer and clock64 stamps (thread 0 of every CTA)
and swaps them in, then reports mean ns and SM cycles per phase after each kernel's PDL wait for
  1. one decode step of the engine (Qwen3-0.6B shape, prompt 512, CUDA graph), per GEMV kind, the skew within
     the attention's clusters, a layer's timeline (when each kernel's CTAs start, return from the wait and end), and
     how evenly each kernel's CTAs sat on the SMs;
  2. 28 attention launches alone in a graph;
  3. 28 x (qkv GEMV -> attention -> o GEMV) in a graph.
usage: python scripts/kernel_phases.py (Hopper GPU, nvcc). Stamps cost a few hundred ns a kernel."""
import ctypes
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from nanovllm.kernels import cuda_library  # noqa: E402

RECORD = 32  # words a CTA: kind, pointer, block, SM, 14 globaltimer stamps, 14 clock64 stamps
HEADER = r'''
__device__ unsigned long long g_stamps[32 * 200000];
__device__ unsigned int g_count;
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned int sm_id() { unsigned int s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
extern "C" int stamps_read(unsigned long long* host, int max_records) {
  unsigned int n = 0; cudaMemcpyFromSymbol(&n, g_count, 4);
  if (n > (unsigned)max_records) n = max_records;
  cudaMemcpyFromSymbol(host, g_stamps, n * 32 * 8); return n; }
extern "C" void stamps_reset() { unsigned int z = 0; cudaMemcpyToSymbol(g_count, &z, 4); cudaDeviceSynchronize(); }
#define REC_INIT(KIND, PTR) unsigned long long* rec = nullptr; if (threadIdx.x == 0) { \
  rec = g_stamps + 32 * (atomicAdd(&g_count, 1u) % 200000u); rec[0] = KIND; rec[1] = (unsigned long long)(PTR); \
  rec[2] = blockIdx.x + 1000 * blockIdx.y; rec[3] = sm_id(); for (int q_ = 4; q_ < 32; ++q_) rec[q_] = 0; }
#define STAMP(k) if (threadIdx.x == 0) { rec[4 + (k)] = gtime(); rec[18 + (k)] = clock64(); }
'''
GEMV, ATTENTION = 1, 2
# (anchor in the source, stamp code, after the anchor?)
GEMV_STAMPS = [
    ("  const int rows = min(rows_per_cta, outputs - row0);\n", "  REC_INIT(1, w) STAMP(0)\n", True),
    ("  stage_input<T, MODE, SHARE>(xs, warp_squares, scale, x, residual, blockIdx.x == 0 ? res_out : nullptr, K, eps);\n",
     "  STAMP(1)\n", False),
    ("  stage_input<T, MODE, SHARE>(xs, warp_squares, scale, x, residual, blockIdx.x == 0 ? res_out : nullptr, K, eps);\n",
     "  STAMP(2)\n", True),
    ("    while (rows * ready / chunks <= r) barrier_wait(&arrived[ready++], 0);\n", "    STAMP(3)\n", True),
    ("    if (threadIdx.x % 32 == 0) y[row0 + r] = from_float<T>(acc);\n  }\n", "  STAMP(4)\n", True),
]
GEMV_PHASES = ["start -> wait returned", "stage input", "until warp 0's last chunk", "rest of dots + store"]
ATTENTION_STAMPS = [
    ("  // Before the wait: nothing here reads what the kernel before writes.\n",
     "  REC_INIT(2, p.k_cache) STAMP(0)\n", True),
    ("  wait_for_prior_kernel();  // q, k and v of this step are its output\n", "  STAMP(1)\n", False),
    ("  wait_for_prior_kernel();  // q, k and v of this step are its output\n", "  STAMP(2)\n", True),
    ("  float m_run[GROUP], l_run[GROUP], acc[GROUP][L::kPvDims];\n", "  STAMP(3)\n", False),
    ("    __syncwarp();\n    // the warp's softmax state", "    STAMP(4)\n", False),
    ("    __syncwarp();\n    // weighted sums of V", "    STAMP(5)\n", False),
    ("  // the warps' states into one for the CTA", "  STAMP(6)\n", False),
    ("  if (threadIdx.x == 0) barrier_expect(&sh.inbox_full, Sh::kInboxBytes);\n", "  STAMP(7)\n", False),
    ("  barrier_wait(&sh.inbox_full, 0);  // every split's sends have landed\n", "  STAMP(8)\n", True),
    ("    if (s == 0) out[g * p.stride_oh + d] = from_float<T>(den > 0.f ? num / den : 0.f);\n  }\n", "  STAMP(9)\n",
     True),
]
ATTENTION_PHASES = ["start -> wait call", "wait", "q/k loads + rotary", "scores", "softmax", "P.V", "to smem + sync",
                    "combine + send + inbox wait", "merge + store"]


def stamped(name: str, stamps) -> str:
    src = (cuda_library.CSRC / f"{name}.cu").read_text().replace('#include "common.cuh"',
                                                                   '#include "common.cuh"\n' + HEADER)
    for anchor, code, after in stamps:
        assert src.count(anchor) == 1, f"{name}.cu changed: {anchor!r}"
        src = src.replace(anchor, anchor + code if after else code + anchor)
    return src


def build(folder: Path) -> list[ctypes.CDLL]:
    """Both stamped libraries, registered where the kernels' wrappers look them up."""
    libraries = []
    for name, stamps in (("gemv_one_row", GEMV_STAMPS), ("paged_decode_cluster", ATTENTION_STAMPS)):
        source = cuda_library.CSRC / f"stamped_{name}.cu"  # beside common.cuh
        source.write_text(stamped(name, stamps))
        try:
            target = folder / f"{name}.so"
            done = subprocess.run([cuda_library.nvcc(), *cuda_library.NVCC_FLAGS, "-o", str(target), str(source)],
                                  capture_output=True, text=True)
        finally:
            source.unlink()
        assert done.returncode == 0, done.stderr[-3000:]
        library = ctypes.CDLL(str(target))
        library.nanovllm_cuda_error_string.restype = ctypes.c_char_p
        library.nanovllm_cuda_error_string.argtypes = [ctypes.c_int]
        library.stamps_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
        cuda_library._libraries[name] = library
        libraries.append(library)
    return libraries


def read(libraries) -> list[list[int]]:
    """Every CTA record since the last read."""
    torch.cuda.synchronize()
    records = []
    for library in libraries:
        buffer = (ctypes.c_ulonglong * (RECORD * 200000))()
        n = library.stamps_read(ctypes.addressof(buffer), 200000)
        records += [list(buffer[RECORD * i:RECORD * (i + 1)]) for i in range(n)]
        library.stamps_reset()
    return records


def report(records, kind: int, label: str):
    names = ATTENTION_PHASES if kind == ATTENTION else GEMV_PHASES
    rows = [r for r in records if r[0] == kind]
    if not rows:
        return
    ns = [sum(r[5 + i] - r[4 + i] for r in rows) / len(rows) for i in range(len(names))]
    cycles = [sum(r[19 + i] - r[18 + i] for r in rows) / len(rows) for i in range(len(names))]
    last = len(names)
    mhz = sum(r[18 + last] - r[18] for r in rows) / max(1, sum(r[4 + last] - r[4] for r in rows)) * 1000
    print(f"{label}: {len(rows)} CTAs, SM clock {mhz:.0f} MHz")
    print("  " + " | ".join(f"{n}: {a:.0f} ns / {c:.0f} cycles" for n, a, c in zip(names, ns, cycles)))


def engine_step(libraries):
    from nanovllm import LLM, SamplingParams
    from nanovllm.weights.synthetic import write_model

    model = str(write_model("qwen3-0.6b", tempfile.mkdtemp(), torch.bfloat16))
    llm = LLM(model, device="cuda", dtype=torch.bfloat16, max_model_len=1024, max_num_seqs=1,
              enable_prefix_caching=False)
    prompt = {"prompt_token_ids": [random.Random(0).randint(100, 20000) for _ in range(512)]}
    llm.generate([prompt], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    read(libraries)
    llm.generate([prompt], SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)  # prefill + one decode
    records = read(libraries)
    owners = {}  # a record's pointer -> (layer, kernel kind)
    for i, layer in enumerate(llm.llm_engine.model_runner.model.model.layers):
        for kind, tensor in (("qkv", layer.self_attn.qkv_proj.weight), ("attention", layer.self_attn.attn.k_cache),
                             ("o", layer.self_attn.o_proj.weight), ("gate_up", layer.mlp.gate_up_proj.weight),
                             ("down", layer.mlp.down_proj.weight)):
            owners[tensor.data_ptr()] = (i, kind)
    records = first_step(records, owners)
    report(records, ATTENTION, "engine decode step, attention")
    for kind in ("qkv", "o", "gate_up", "down"):
        report([r for r in records if r[0] == GEMV and owners.get(r[1], (0, None))[1] == kind], GEMV,
               f"engine decode step, {kind}")
    num_layers = len(llm.llm_engine.model_runner.model.model.layers)
    timeline(records, owners, num_layers)
    crowding(records, owners, num_layers)
    config = llm.llm_engine.model_runner.hf_config
    head_readiness(records, owners, num_layers, config.num_attention_heads, config.num_key_value_heads,
                   config.head_dim)
    clusters = {}
    for r in records:
        if r[0] == ATTENTION:
            clusters.setdefault((r[1], r[2] // 1000), []).append(r)
    for stamp, what in ((2, "wait returned"), (7, "before the sends"), (8, "past the inbox wait")):
        spread = [max(r[4 + stamp] for r in rs) - min(r[4 + stamp] for r in rs) for rs in clusters.values()]
        print(f"  attention, spread within a cluster of '{what}': mean {sum(spread) / len(spread):.0f} ns, "
              f"max {max(spread)} ns")


def first_step(records, owners: dict) -> list:
    """The records of the first decode step only: the engine may have run the next one already (asynchronous
    scheduling), and two steps' CTAs of one kernel would mix in every figure. A step begins with layer 0's qkv GEMV;
    the second step's begins after the largest gap between that GEMV's CTA starts."""
    starts = sorted(r[4] for r in records if owners.get(r[1]) == (0, "qkv"))
    gaps = [(b - a, b) for a, b in zip(starts, starts[1:])]
    if not gaps or max(gaps)[0] < 100_000:  # one step (its CTAs start within ~10 us)
        return records
    second = max(gaps)[1]
    return [r for r in records if r[4] < second]


KERNELS = ("qkv", "attention", "o", "gate_up", "down")
# stamp indices: a CTA's start, its wait returning, its end
MOMENTS = {GEMV: (0, 1, 4), ATTENTION: (0, 2, 9)}


def by_kernel(records, owners: dict) -> dict:
    """The records grouped by their kernel: (layer, kind) -> CTA records."""
    groups = {}
    for r in records:
        if r[1] in owners:
            groups.setdefault(owners[r[1]], []).append(r)
    return groups


def timeline(records, owners: dict, num_layers: int):
    """When each kernel of a layer runs, in ns after the layer's qkv GEMV first returns from its wait, averaged over
    the middle layers: its CTAs' first / median / last start (did they find room, and how early), the first and
    last return from the wait, and the last CTA's end. A kernel whose CTAs start only after the one two places
    before it ended did not launch two kernels ahead."""
    groups = by_kernel(records, owners)
    columns = ["first start", "median start", "last start", "first wait return", "last wait return", "last end"]
    sums = {kind: [0.0] * len(columns) for kind in KERNELS}
    layers = range(1, num_layers - 1)
    for layer in layers:
        rows = {kind: groups.get((layer, kind), []) for kind in KERNELS}
        if not all(rows.values()):
            return
        origin = min(r[4 + MOMENTS[r[0]][1]] for r in rows["qkv"])
        for kind in KERNELS:
            start, wait, end = MOMENTS[rows[kind][0][0]]
            starts = sorted(r[4 + start] for r in rows[kind])
            waits = [r[4 + wait] for r in rows[kind]]
            figures = [starts[0], starts[len(starts) // 2], starts[-1], min(waits), max(waits),
                       max(r[4 + end] for r in rows[kind])]
            sums[kind] = [a + f - origin for a, f in zip(sums[kind], figures)]
    print(f"timeline of a layer (ns after its qkv's first wait return, mean of layers {layers.start}-{layers.stop - 1})")
    print("| kernel | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 1) + "|")
    for kind in KERNELS:
        print(f"| {kind} | " + " | ".join(f"{v / len(layers):,.0f}" for v in sums[kind]) + " |")


def crowding(records, owners: dict, num_layers: int):
    """How evenly each kernel's CTAs sat on the SMs (the hardware places them where room appears), and what that cost:
    over the middle layers, how many SMs held 1, 2, ... of a kernel's CTAs, and the mean CTA end (ns after the
    kernel's first wait return) by how many of its kernel's CTAs shared the SM. The last CTA holds the next kernel."""
    groups = by_kernel(records, owners)
    for kind in KERNELS:
        held, ends = Counter(), {}
        for layer in range(1, num_layers - 1):
            rows = groups.get((layer, kind), [])
            if not rows:
                return
            _, wait, end = MOMENTS[rows[0][0]]
            per_sm = Counter(r[3] for r in rows)
            held.update(per_sm.values())
            origin = min(r[4 + wait] for r in rows)
            for r in rows:
                ends.setdefault(per_sm[r[3]], []).append(r[4 + end] - origin)
        print(f"  {kind}: SMs holding n of its CTAs {dict(sorted(held.items()))}; mean CTA end by n: "
              + ", ".join(f"{n}: {sum(v) / len(v):,.0f}" for n, v in sorted(ends.items())))


def head_readiness(records, owners: dict, num_layers: int, heads: int, kv_heads: int, head_dim: int):
    """How much earlier the attention could start if each kv head waited only for the qkv CTAs holding its rows
    (its q heads', its k's and its v's), or began on its q rows alone (the cached positions need no k or v of this
    step), instead of the whole qkv GEMV: over the middle layers, ns before the qkv GEMV's last CTA end at which a
    head's rows were all written (a CTA's end stamp: its warp 0's last row), for the mean head and the last head
    (the one the o GEMV waits for), and the attention's first wait return for scale."""
    groups = by_kernel(records, owners)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    n = q_size + 2 * kv_size
    group = heads // kv_heads
    figures = {"all rows, mean head": [], "all rows, last head": [], "q rows, mean head": [], "q rows, last head": [],
               "attention's first wait return (after)": []}
    for layer in range(1, num_layers - 1):
        qkv, attention = groups.get((layer, "qkv"), []), groups.get((layer, "attention"), [])
        if not qkv or not attention:
            return
        per_cta = -(-n // len(qkv))
        end = {r[2] % 1000: r[4 + MOMENTS[GEMV][2]] for r in qkv}
        last = max(end.values())
        before_all, before_q = [], []
        for h in range(kv_heads):
            q = range(h * group * head_dim, (h + 1) * group * head_dim)
            kv = [*range(q_size + h * head_dim, q_size + (h + 1) * head_dim),
                  *range(q_size + kv_size + h * head_dim, q_size + kv_size + (h + 1) * head_dim)]
            before_q.append(last - max(end[row // per_cta] for row in q))
            before_all.append(last - max(end[row // per_cta] for row in (*q, *kv)))
        for name, values in (("all rows", before_all), ("q rows", before_q)):
            figures[f"{name}, mean head"].append(sum(values) / len(values))
            figures[f"{name}, last head"].append(min(values))
        figures["attention's first wait return (after)"].append(min(r[4 + MOMENTS[ATTENTION][1]] for r in attention)
                                                                - last)
    print(f"  a kv head's qkv rows written, ns before the qkv GEMV's last CTA end (mean of layers 1-{num_layers - 2}): "
          + ", ".join(f"{name} {sum(v) / len(v):,.0f}" for name, v in figures.items()))


def graphs(libraries):
    """28 attention launches alone, then 28 x (qkv GEMV -> attention -> o GEMV), each replayed in a graph."""
    from test_paged_decode_cluster import _decode_step

    from nanovllm.kernels import paged_decode_cluster as cluster
    from nanovllm.kernels.gemv_one_row import gemv_one_row

    args, _, _, _ = _decode_step(([640], 16, 16, 8, 128), torch.bfloat16, True, seed=8)
    q, k, v, k_cache, v_cache, tables, lens, slots, scale, rope = args
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(28)]
    g = torch.Generator().manual_seed(9)
    weights = [((torch.randn(4096, 1024, generator=g) * 0.03).to(torch.bfloat16).cuda(),
                (torch.randn(1024, 2048, generator=g) * 0.03).to(torch.bfloat16).cuda()) for _ in range(28)]
    x = torch.zeros(1, 1024, dtype=torch.bfloat16, device="cuda")
    qkv = torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda")

    def alone():
        for kc, vc in caches:
            cluster.paged_decode_cluster(q, k, v, kc, vc, tables, lens, slots, scale, rope, splits=16, cap=128)

    def chain():
        for (w_qkv, w_o), (kc, vc) in zip(weights, caches):
            gemv_one_row(x, w_qkv, out=qkv)
            views = (qkv[:, :2048].view(1, 16, 128), qkv[:, 2048:3072].view(1, 8, 128), qkv[:, 3072:].view(1, 8, 128))
            out = cluster.paged_decode_cluster(*views, kc, vc, tables, lens, slots, scale, rope, splits=16, cap=128)
            gemv_one_row(out.view(1, -1), w_o, out=x)

    for label, fn in (("attention x28 alone", alone), ("qkv -> attention -> o, x28", chain)):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        read(libraries)
        graph.replay()
        records = read(libraries)
        report(records, ATTENTION, f"{label}, attention")
        report(records, GEMV, f"{label}, GEMVs")


def main():
    with tempfile.TemporaryDirectory() as folder:
        libraries = build(Path(folder))
        engine_step(libraries)
        torch.cuda.empty_cache()
        graphs(libraries)


if __name__ == "__main__":
    main()
