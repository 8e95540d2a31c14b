"""KV blocks in host memory (pinned on CUDA; `kv_offloading_size` GiB, vLLM's name) that a preempted sequence's KV
is swapped into instead of being dropped and recomputed, where the copy out and back costs less than the recompute.
Copies move whole blocks across every layer with torch index copies (the twin of an sgDMA path to come)."""
import time

import torch

from nanovllm.logger import logger


class SwapSpace:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int, flops_per_token: float):
        """kv_cache: the device cache [2, layers, blocks, block_size, kv_heads, head_dim]; flops_per_token: what
        recomputing one token of KV costs (the model's forward)."""
        self.kv_cache = kv_cache
        self.pool = torch.empty((*kv_cache.shape[:2], num_blocks, *kv_cache.shape[3:]), dtype=kv_cache.dtype,
                                pin_memory=kv_cache.is_cuda)
        self.free_blocks = list(range(num_blocks))
        self.block_bytes = self.pool[:, :, 0].numel() * self.pool.element_size()
        self.block_size = kv_cache.shape[3]
        self.bandwidth, self.flops = self._measure(kv_cache.device)
        self.flops_per_token = flops_per_token
        self.choices_logged: set[bool] = set()

    def _measure(self, device: torch.device) -> tuple[float, float]:
        """(bytes a second of a device <-> pool block copy, FLOP/s of a matmul in the cache's dtype), timed once."""
        count = min(len(self.free_blocks), self.kv_cache.shape[2], max(1, (64 << 20) // self.block_bytes))
        blocks = list(range(count))
        copy = _seconds(lambda: self._copy_out(blocks, blocks), device) + \
            _seconds(lambda: self._copy_in(blocks, blocks), device)
        a = torch.randn(512, 2048, dtype=self.kv_cache.dtype, device=device)
        matmul = _seconds(lambda: a @ a.T, device)
        return 2 * len(blocks) * self.block_bytes / copy, 2 * 512 * 512 * 2048 / matmul

    def _copy_out(self, device_blocks: list[int], pool_blocks: list[int]):
        index = torch.tensor(device_blocks, device=self.kv_cache.device)
        self.pool[:, :, pool_blocks] = self.kv_cache[:, :, index].cpu()

    def _copy_in(self, pool_blocks: list[int], device_blocks: list[int]):
        index = torch.tensor(device_blocks, device=self.kv_cache.device)
        self.kv_cache[:, :, index] = self.pool[:, :, pool_blocks].to(self.kv_cache.device, non_blocking=True)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def swap_beats_recompute(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether copying num_blocks out and back costs less than recomputing num_tokens of KV; the first choice
        each way is logged with its figures."""
        copy = 2 * num_blocks * self.block_bytes / self.bandwidth
        recompute = num_tokens * self.flops_per_token / self.flops
        swap = copy < recompute
        if swap not in self.choices_logged:
            self.choices_logged.add(swap)
            logger.info(f"preemption {'swaps KV to host memory' if swap else 'recomputes KV'}: a copy out and back "
                        f"at {self.bandwidth / 1e9:.1f} GB/s against the recompute at {self.flops / 1e12:.2f} TFLOP/s "
                        f"({num_tokens} tokens: {copy * 1e3:.2f} vs {recompute * 1e3:.2f} ms)")
        return swap

    def swap_out(self, device_blocks: list[int]) -> list[int] | None:
        """Copy these device blocks into free pool blocks and return those, or None where the pool lacks room."""
        if len(device_blocks) > len(self.free_blocks):
            return None
        pool_blocks = [self.free_blocks.pop() for _ in device_blocks]
        self._copy_out(device_blocks, pool_blocks)
        return pool_blocks

    def swap_in(self, pool_blocks: list[int], device_blocks: list[int]):
        """Copy pool blocks back into these device blocks and free them."""
        self._copy_in(pool_blocks, device_blocks)
        self.release(pool_blocks)

    def release(self, pool_blocks: list[int]):
        self.free_blocks.extend(pool_blocks)


def _seconds(fn, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
