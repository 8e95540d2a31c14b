"""The small-batch GEMV kernel against F.linear (cuBLAS) and HBM bandwidth, at real layer shapes.
usage: python scripts/gemv_sweep.py [tiles|one_row]
tiles (default): the best of CONFIGS per shape; one_row: one row of x, the Triton GEMV against the CUDA one-row
kernel in each of its modes (back to back in one graph)."""
import itertools
import sys

import torch
import torch.nn.functional as F
from gpu_timing import copies_needed, graph_time

sys.path.insert(0, ".")
from bench import measure_hbm_bandwidth  # noqa: E402
from nanovllm.kernels.gemv import gemv  # noqa: E402

SHAPES = {  # (N, K) of each projection
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048), "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072), "qwen3-0.6b lm_head": (151936, 1024),
    "llama3-8b qkv": (6144, 4096), "llama3-8b o": (4096, 4096), "llama3-8b gate_up": (28672, 4096),
    "llama3-8b down": (4096, 14336),
}
CONFIGS = list(itertools.product((16, 32, 64), (128, 256, 512), (3, 4, 6), (4,)))


def one_row_table(bw):
    from nanovllm.kernels.gemv_one_row import fits, gemv_one_row

    norm_weight = torch.ones(8192, dtype=torch.bfloat16, device="cuda")
    print("| shape | Triton gemv us | of bw | one-row plain us | of bw | add_norm us | silu_mul us |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies_needed(nbytes))]
        if not fits(weights[0]):
            continue
        x, gate_up = (torch.randn(1, m * k, dtype=torch.bfloat16, device="cuda") for m in (1, 2))
        residual = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(gemv_one_row(x, weights[0])[0], F.linear(x, weights[0]), atol=2e-2, rtol=2e-2)
        times = [graph_time([lambda w=w: gemv(x, w) for w in weights]),
                 graph_time([lambda w=w: gemv_one_row(x, w) for w in weights]),
                 graph_time([lambda w=w: gemv_one_row(x, w, None, "add_norm", residual, norm_weight[:k], 1e-6)
                             for w in weights]),
                 graph_time([lambda w=w: gemv_one_row(gate_up, w, mode="silu_mul") for w in weights])]
        print(f"| {name} | {times[0] * 1e6:.1f} | {nbytes / times[0] / bw:.0%} | {times[1] * 1e6:.1f} "
              f"| {nbytes / times[1] / bw:.0%} | {times[2] * 1e6:.1f} | {times[3] * 1e6:.1f} |")
        del weights


bw = measure_hbm_bandwidth()
print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, bf16")
if sys.argv[1:] == ["one_row"]:
    one_row_table(bw)
    sys.exit()
print("| shape | M | F.linear us | of bw | best gemv us | of bw | speedup | config (block_n, block_k, stages, warps) |")
print("|---|---|---|---|---|---|---|---|")
for name, (n, k) in SHAPES.items():
    nbytes = n * k * 2
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies_needed(nbytes))]
    for m in (1, 4, 16):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        want = F.linear(x, weights[0])
        base = graph_time([lambda w=w: F.linear(x, w) for w in weights])
        best = (float("inf"), None)
        for cfg in CONFIGS:
            bn, bk, st, wp = cfg
            launch = dict(block_n=bn, block_k=bk, num_stages=st, num_warps=wp)
            try:
                got = gemv(x, weights[0], **launch)
            except Exception:  # out of shared memory
                continue
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            best = min(best, (graph_time([lambda w=w: gemv(x, w, **launch) for w in weights]), cfg))
        s, cfg = best
        print(f"| {name} | {m} | {base * 1e6:.1f} | {nbytes / base / bw:.0%} | {s * 1e6:.1f} "
              f"| {nbytes / s / bw:.0%} | {base / s:.2f}x | {cfg} |")
    del weights
