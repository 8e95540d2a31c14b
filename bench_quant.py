"""Quantized weights against the HBM bandwidth measured in the same run. Mode `kernels`: one projection layer at each
of Llama-3-8B's shapes, served as the engine serves it (the CUDA one-row GEMV, the Triton GEMV, or the many-row
path, by type and row count), its weight bytes read per second against the copy bandwidth, beside the dense bf16
layer of the same shape (graph-replayed, every call on its own copy of the layer so that it reads HBM, not L2).
Types: the GGUF kernel types (fp16 x, the GGUF default), INT4_G128 (quantization='int4', fp16 x), int8 and fp8
(bf16 x).

    python bench_quant.py kernels [--types Q4_0 int8] [--rows 1]
"""
import argparse
import datetime

import numpy as np
import torch

from nanovllm.kernels.gguf_gemv import KERNEL_TYPES
from nanovllm.layers.gemv_linear import TritonGemvLinearMethod
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.quant.gguf_weight import GGUFWeight
from nanovllm.quant.registry import get_quantization_config
from nanovllm.utils.benchmarking import copies_needed, graph_time, measure_hbm_bandwidth
from nanovllm.weights.random_blocks import random_blocks

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # Llama-3-8B
TYPES = [*KERNEL_TYPES, "int8", "fp8"]
CUDA = torch.device("cuda")


def layer(type_name: str, n: int, k: int) -> ReplicatedLinear:
    """A [n, k] projection holding random weights of this type, loaded as the engine loads it."""
    if type_name == "bf16":
        linear = ReplicatedLinear(k, n, linear_method=TritonGemvLinearMethod()).to(torch.bfloat16)
        linear.weight.data.normal_(0, k ** -0.5)
        return linear
    dtype = torch.bfloat16 if type_name in ("int8", "fp8") else torch.float16
    config = get_quantization_config(type_name if type_name in ("int8", "fp8") else "gguf", CUDA, dtype, True)
    linear = ReplicatedLinear(k, n, linear_method=config.linear_method())
    if type_name in ("int8", "fp8"):
        loaded = torch.randn(n, k, device=CUDA) * k ** -0.5
    else:
        raw = random_blocks(type_name, n, k, k ** -0.5, np.random.default_rng(0))
        loaded = GGUFWeight.from_blocks(torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8), type_name, (n, k))
    linear.weight_loader(linear.weight, loaded)
    config.finish_loading(torch.nn.ModuleDict({"proj": linear}))
    return linear


def layer_bytes(linear: ReplicatedLinear) -> int:
    tensors = [t for t in (linear.weight, getattr(linear, "qweight", None), getattr(linear, "weight_scale", None))
               if t is not None]
    return sum(t.nbytes for t in tensors) + sum(w.nbytes for _, w in getattr(linear, "qweights", []))


def time_layers(type_name: str, n: int, k: int, rows: int) -> tuple[float, int]:
    """(seconds a call, weight bytes) of the engine's path for this type and row count."""
    first = layer(type_name, n, k)
    nbytes = layer_bytes(first)
    layers = [first] + [layer(type_name, n, k) for _ in range(copies_needed(nbytes) - 1)]
    dtype = torch.bfloat16 if type_name in ("int8", "fp8", "bf16") else torch.float16
    x = torch.randn(rows, k, dtype=dtype, device=CUDA)
    seconds = graph_time([lambda linear=linear: linear(x) for linear in layers])
    del layers
    torch.cuda.empty_cache()
    return seconds, nbytes


def bench_kernels(args):
    bw = measure_hbm_bandwidth()
    print(f"\n| device | date | mode | config |\n|---|---|---|---|\n| {torch.cuda.get_device_name()} | "
          f"{datetime.date.today()} | kernels | Llama-3-8B projections, {args.rows} row(s) of x; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s |\n")
    print("| type | shape | bytes | us | of HBM bw | bf16 layer us | speed-up |\n|---|---|---|---|---|---|---|")
    torch.set_default_device(CUDA)
    dense = {name: time_layers("bf16", n, k, args.rows)[0] for name, (n, k) in SHAPES.items()}
    for type_name in args.types:
        for name, (n, k) in SHAPES.items():
            seconds, nbytes = time_layers(type_name, n, k, args.rows)
            print(f"| {type_name} | {name} {n}x{k} | {nbytes / 1e6:.1f} MB | {seconds * 1e6:.1f} | "
                  f"{nbytes / seconds / bw:.0%} | {dense[name] * 1e6:.1f} | {dense[name] / seconds:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["kernels"])
    ap.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    bench_kernels(args)


if __name__ == "__main__":
    main()
