"""Quantized weights against the HBM bandwidth measured in the same run. Mode `kernels`: the GGUF GEMV
(kernels/gguf_gemv.py) at Llama-3-8B's projection shapes, one row of x, each type's bytes read per second against
the copy bandwidth, beside the bf16 GEMV of the same shape (graph-replayed, every call on its own copy of the weight
so that it comes from HBM, not L2).

    python bench_quant.py kernels [--types Q4_0 Q4_K] [--rows 1]
"""
import argparse
import datetime
import sys

import numpy as np
import torch
import triton

from bench import measure_hbm_bandwidth
from nanovllm.kernels.gemv import gemv
from nanovllm.kernels.gguf_gemv import KERNEL_TYPES, gguf_gemv
from nanovllm.quant.gguf_weight import GGUFWeight
from nanovllm.weights.synthetic_gguf import random_blocks

sys.path.insert(0, "scripts")
from gpu_timing import copies_needed, graph_time  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # Llama-3-8B
# (block_n, blocks, num_warps): the first is gguf_gemv's default; K-quants take blocks / 8 super-blocks a step
CONFIGS = [(32, 16, 4), (64, 16, 4), (32, 32, 4), (64, 32, 8), (128, 16, 8), (64, 8, 4), (16, 32, 4), (128, 8, 4),
           (16, 16, 2)]


def weight_copies(type_name: str, n: int, k: int) -> list[GGUFWeight]:
    raw = torch.from_numpy(np.ascontiguousarray(random_blocks(type_name, n, k, k ** -0.5, np.random.default_rng(0))))
    first = GGUFWeight.from_blocks(raw.view(torch.uint8), type_name, (n, k)).to("cuda")
    return [first] + [GGUFWeight(type_name, (n, k), {f: t.clone() for f, t in first.fields.items()})
                      for _ in range(copies_needed(first.nbytes) - 1)]


def bench_kernels(args):
    bw = measure_hbm_bandwidth()
    print(f"\n| device | date | mode | config |\n|---|---|---|---|\n| {torch.cuda.get_device_name()} | "
          f"{datetime.date.today()} | kernels | Llama-3-8B projections, {args.rows} row(s) of bf16 x; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s |\n")
    print("| type | shape | bytes | us | of HBM bw | best (block_n, blocks, warps) us | of HBM bw | bf16 GEMV us | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for type_name in args.types:
        for name, (n, k) in SHAPES.items():
            weights = weight_copies(type_name, n, k)
            x = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
            nbytes = weights[0].nbytes
            times = {}
            for c in CONFIGS:
                try:
                    times[c] = graph_time([lambda w=w, c=c: gguf_gemv(x, w, block_n=c[0], blocks=c[1], num_warps=c[2])
                                           for w in weights])
                except triton.runtime.errors.OutOfResources:  # tiles over the shared memory of an SM
                    pass
            default, best = times[CONFIGS[0]], min(times, key=times.get)
            del weights
            dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(copies_needed(n * k * 2))]
            dense_time = graph_time([lambda w=w: gemv(x, w) for w in dense])
            del dense
            print(f"| {type_name} | {name} {n}x{k} | {nbytes / 1e6:.1f} MB | {default * 1e6:.1f} | "
                  f"{nbytes / default / bw:.0%} | {best}: {times[best] * 1e6:.1f} | {nbytes / times[best] / bw:.0%} | "
                  f"{dense_time * 1e6:.1f} | {dense_time / times[best]:.2f}x |")
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["kernels"])
    ap.add_argument("--types", nargs="+", default=list(KERNEL_TYPES), choices=list(KERNEL_TYPES))
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    bench_kernels(args)


if __name__ == "__main__":
    main()
