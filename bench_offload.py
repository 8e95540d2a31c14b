"""KV cache beyond the GPU (issue #42), measured on CUDA.

    python bench_offload.py copies   # KV blocks between the GPU cache and a pinned host pool

copies: whole blocks (every layer, K and V) of a Llama-3-8B-shape KV cache (32 layers, 8 KV heads of 128, bf16) moved
by sgDMA (comm/sgdma.py), by its torch twin (gather, one copy, scatter) and as one contiguous copy of the same bytes,
host to device and back, against the pinned host-to-device bandwidth of a contiguous 1 GiB copy in the same run."""
import argparse
import datetime
import time

import torch

from nanovllm.comm import sgdma

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def seconds(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def pinned_h2d_bandwidth() -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    return host.numel() / seconds(lambda: device.copy_(host, non_blocking=True))


def kv_cache(blocks: int, block_size: int, host: bool) -> torch.Tensor:
    shape = (2, LAYERS, blocks, block_size, KV_HEADS, HEAD_DIM)
    if host:
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda")


def bench_copies(args):
    bound = pinned_h2d_bandwidth()
    print(f"\n| device | date | config |\n|---|---|---|\n| {torch.cuda.get_device_name()} | {datetime.date.today()} | "
          f"Llama-3-8B KV ({LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM}, bf16); pinned host pool; "
          f"pinned H2D of 1 GiB contiguous: {bound / 1e9:.1f} GB/s; sgDMA: {sgdma.why_off(torch.device('cuda')) or 'on'} |\n")
    print("| block size | blocks moved | block ids | direction | MB | sgDMA GB/s | torch twin GB/s | contiguous GB/s | "
          "sgDMA / pinned H2D |\n|---|---|---|---|---|---|---|---|---|")
    for block_size, count in ((16, 64), (16, 512), (256, 32)):
        device_blocks, host_blocks = 4 * count, 2 * count
        gpu, pool = kv_cache(device_blocks, block_size, False), kv_cache(host_blocks, block_size, True)
        nbytes = count * gpu[:, :, 0].numel() * gpu.element_size()
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for ids in ("scattered", "consecutive"):
            if ids == "scattered":
                gpu_ids = torch.randperm(device_blocks)[:count].tolist()
                pool_ids = torch.randperm(host_blocks)[:count].tolist()
            else:
                gpu_ids, pool_ids = list(range(count, 2 * count)), list(range(count))
            for direction, (src, dst, s, d, flat) in (
                    ("H2D", (pool, gpu, pool_ids, gpu_ids, (flat_gpu, flat_host))),
                    ("D2H", (gpu, pool, gpu_ids, pool_ids, (flat_host, flat_gpu)))):
                t_sg = seconds(lambda: sgdma.copy_blocks(src, dst, s, d))
                t_torch = seconds(lambda: sgdma.torch_copy_blocks(src, dst, s, d), repeat=2)
                t_flat = seconds(lambda: flat[0].copy_(flat[1], non_blocking=True))
                print(f"| {block_size} | {count} | {ids} | {direction} | {nbytes / 1e6:,.0f} | {nbytes / t_sg / 1e9:.1f} | "
                      f"{nbytes / t_torch / 1e9:.1f} | {nbytes / t_flat / 1e9:.1f} | {nbytes / t_sg / bound:.0%} |",
                      flush=True)
        del gpu, pool, flat_host, flat_gpu
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["copies"])
    args = ap.parse_args()
    {"copies": bench_copies}[args.mode](args)


if __name__ == "__main__":
    main()
