"""KV blocks in host memory (pinned on CUDA; `kv_offloading_size` GiB, vLLM's name), for two uses:
- swap preemption: a preempted sequence's KV is copied here and back instead of being dropped and recomputed
  (kvcache/preemption.py chooses);
- a second tier of the prefix cache: a cached block that the device evicts keeps its KV here (least recently
  used first out), and a later prompt with that prefix loads it instead of recomputing it.
The pool keeps the bookkeeping; its copies are listed for the next step to execute (kvcache/block_copy.py)."""
from collections import OrderedDict

import torch

from nanovllm.kvcache.block_copy import IN, OUT, BlockCopy, queue_copy


class HostKVPool:
    """Blocks held by swapped sequences are theirs until they resume; the others are free or hold cached prefix
    blocks, which give way (least recently used first) when a block is needed."""

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int):
        """kv_cache: the device cache [2, layers, blocks, block_size, kv_heads, head_dim]."""
        self.kv_cache = kv_cache
        self.pool = torch.empty((*kv_cache.shape[:2], num_blocks, *kv_cache.shape[3:]), dtype=kv_cache.dtype,
                                pin_memory=kv_cache.is_cuda)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: ascending runs copy as one
        self.cached: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (block, its tokens)
        self.checked_out: set[int] = set()  # hashes of cached blocks between checkout and load_prefix
        self.block_bytes = self.pool[:, :, 0].numel() * self.pool.element_size()
        self.block_size = kv_cache.shape[3]
        self.pending_copies: list[BlockCopy] = []  # decided, for the next step to execute (kvcache/block_copy.py)
        self.copied_blocks = 0  # statistics: blocks copied either way (swaps, offloads, the prefix tier)

    def _copy_out(self, device_blocks: list[int], pool_blocks: list[int]):
        queue_copy(self.pending_copies, OUT, device_blocks, pool_blocks)
        self.copied_blocks += len(pool_blocks)

    def _copy_in(self, pool_blocks: list[int], device_blocks: list[int]):
        queue_copy(self.pending_copies, IN, pool_blocks, device_blocks)
        self.copied_blocks += len(pool_blocks)

    def take_copies(self) -> list[BlockCopy]:
        """The copies decided since the last call, in order: the next step's to execute."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def num_free_blocks(self) -> int:
        """Blocks no swapped sequence holds (free, or holding a cached prefix block)."""
        return len(self.free_blocks) + len(self.cached)

    def _take_block(self) -> int:
        if not self.free_blocks:
            _, (block, _) = self.cached.popitem(last=False)
            return block
        return self.free_blocks.pop()

    def take(self, num_blocks: int) -> list[int]:
        """num_blocks free pool blocks (evicting cached prefix blocks where needed), ascending; the caller checked
        num_free_blocks."""
        return sorted(self._take_block() for _ in range(num_blocks))

    def swap_out(self, device_blocks: list[int]) -> list[int] | None:
        """Copy these device blocks into free pool blocks and return those, or None where the pool lacks room."""
        if len(device_blocks) > self.num_free_blocks:
            return None
        pool_blocks = self.take(len(device_blocks))  # ascending: a run copies in one call
        self._copy_out(device_blocks, pool_blocks)
        return pool_blocks

    def swap_in(self, pool_blocks: list[int], device_blocks: list[int]):
        """Copy pool blocks back into these device blocks and free them."""
        self._copy_in(pool_blocks, device_blocks)
        self.release(pool_blocks)

    def release(self, pool_blocks: list[int]):
        self.free_blocks.extend(reversed(pool_blocks))  # popped from the end: taken again in their order

    def store_prefix(self, block_hash: int, token_ids: tuple[int, ...], device_block: int):
        """Keep the KV of a prefix-cache block that the device is about to reuse (nothing where swapped sequences
        hold every block)."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
        elif self.num_free_blocks and block_hash not in self.checked_out:  # a checked-out one is kept already
            block = self._take_block()
            self._copy_out([device_block], [block])
            self.cached[block_hash] = (block, token_ids)

    def find_prefix(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        entry = self.cached.get(block_hash)
        return entry is not None and entry[1] == token_ids

    def checkout(self, block_hashes: list[int]) -> list[tuple[int, tuple[int, tuple[int, ...]]]]:
        """Take cached prefix blocks out of the eviction order until load_prefix puts them back."""
        self.checked_out.update(block_hashes)
        return [(h, self.cached.pop(h)) for h in block_hashes]

    def load_prefix(self, held: list[tuple[int, tuple[int, tuple[int, ...]]]], device_blocks: list[int]):
        """Copy checked-out prefix blocks into device blocks; they stay cached here, now the most recently used."""
        self._copy_in([block for _, (block, _) in held], device_blocks)
        self.cached.update(held)
        self.checked_out.difference_update(h for h, _ in held)

    def adopt(self, held: list[tuple[int, tuple[int, tuple[int, ...]]]]) -> list[int]:
        """Checked-out prefix blocks handed to a sequence as its own pool blocks (an offloaded prompt's leading KV,
        not loaded to the device): they leave the cache until keep() brings them back."""
        self.checked_out.difference_update(h for h, _ in held)
        return [block for _, (block, _) in held]

    def keep(self, entries: list[tuple[int, tuple[int, ...], int]]):
        """A finished sequence's pool blocks of full, computed blocks, (hash, tokens, block) each: cached as prefix
        blocks, the most recently used (a block whose prefix is cached already is freed)."""
        for block_hash, token_ids, block in entries:
            if block_hash in self.cached or block_hash in self.checked_out:
                self.release([block])
            else:
                self.cached[block_hash] = (block, token_ids)

    def reset_prefix_cache(self):
        self.free_blocks.extend(block for block, _ in self.cached.values())
        self.cached.clear()

