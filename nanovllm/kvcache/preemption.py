"""Swap or recompute: whether a preempted sequence's KV is copied to the host pool and back, or dropped and
computed again. `preemption_mode` pins the choice; left at None, it follows the costs measured at start-up: the copy
out and back at the link's block-copy bandwidth against the recompute at the device's matmul FLOP/s."""
import time
from dataclasses import dataclass

import torch

from nanovllm.comm.sgdma import copy_blocks
from nanovllm.logger import log_once

PREEMPTION_MODES = (None, "swap", "recompute")


@dataclass(frozen=True)
class PreemptionPolicy:
    mode: str | None  # "swap" / "recompute" pinned, or None: by the costs below
    block_bytes: int = 0  # one KV block across every layer
    flops_per_token: float = 0  # the forward's FLOPs for one token (what recomputing its KV costs)
    link_bandwidth: float = 0  # bytes a second of a device <-> host block copy
    flops: float = 0  # FLOP/s of a matmul in the cache's dtype

    def swaps(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens computed tokens in num_blocks blocks swaps rather than recomputes."""
        if self.mode is not None:
            return self.mode == "swap"
        copy = 2 * num_blocks * self.block_bytes / self.link_bandwidth
        recompute = num_tokens * self.flops_per_token / self.flops
        swap = copy < recompute
        log_once(f"preemption {'swaps KV to host memory' if swap else 'recomputes KV'} where the copy out and back at "
                 f"{self.link_bandwidth / 1e9:.1f} GB/s costs {'less' if swap else 'more'} than the recompute at "
                 f"{self.flops / 1e12:.2f} TFLOP/s (first case: {num_tokens} tokens, {copy * 1e3:.2f} vs "
                 f"{recompute * 1e3:.2f} ms); preemption_mode='swap' or 'recompute' pins it")
        return swap


def preemption_policy(mode: str | None, kv_cache: torch.Tensor, pool: torch.Tensor | None, hf_config,
                      attention) -> PreemptionPolicy:
    """preemption_mode as set, or (None, with a host pool) the swap-or-recompute costs measured now. attention: one
    of the model's attention layers (its heads give the layer's parameter count)."""
    if pool is None or mode is not None:
        return PreemptionPolicy(mode or "recompute")
    c = hf_config
    q, kv = attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
    layer_params = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return measured_policy(kv_cache, pool, 2 * c.num_hidden_layers * layer_params)


def measured_policy(kv_cache: torch.Tensor, pool: torch.Tensor, flops_per_token: float) -> PreemptionPolicy:
    """The costs timed once: a copy of up to 64 MiB of blocks each way between the device cache and the pool, and a
    matmul in the cache's dtype."""
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    count = min(pool.shape[2], kv_cache.shape[2], max(1, (64 << 20) // block_bytes))
    blocks = list(range(count))
    copy = _seconds(lambda: copy_blocks(kv_cache, pool, blocks, blocks), kv_cache.device) + \
        _seconds(lambda: copy_blocks(pool, kv_cache, blocks, blocks), kv_cache.device)
    a = torch.randn(512, 2048, dtype=kv_cache.dtype, device=kv_cache.device)
    matmul = _seconds(lambda: a @ a.T, kv_cache.device)
    return PreemptionPolicy(None, block_bytes, flops_per_token, 2 * count * block_bytes / copy,
                            2 * 512 * 512 * 2048 / matmul)


def _seconds(fn, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
