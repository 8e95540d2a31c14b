from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.kvcache.host_pool import HostKVPool
from nanovllm.kvcache.state_slots import StateSlots


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is full and registered in the prefix cache
        self.token_ids: tuple[int, ...] = ()


def hash_block(parent_hash: int | None, token_ids) -> int:
    """xxhash chain: a block's hash covers its tokens and, through the parent, every token before."""
    h = xxhash.xxh3_64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass
class PrefixHit:
    """The cached blocks that start a sequence: on the device (block ids), then in the host pool (block hashes), then,
    for a prompt whose whole prefix goes to the pool (place_prefill_in_pool), on the device again."""
    device_blocks: list[int] = field(default_factory=list)
    host_hashes: list[int] = field(default_factory=list)
    device_after: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.host_hashes) + len(self.device_after)


class BlockManager:
    """Fixed-size KV blocks with reference counts and a prefix cache keyed by chain hashes.

    Blocks with no reference wait in `free_queue` in eviction order (least recently freed first);
    a cached one among them can still be revived by a prefix hit until it is handed out again. With a host pool,
    a cached block handed out again keeps its KV there, and a prefix found there is loaded back.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_pool: HostKVPool | None = None, state_slots: StateSlots | None = None):
        """state_slots: the linear-attention layers' slots (kvcache/state_slots.py), taken with a sequence's first
        blocks and given back with its last."""
        self.host_pool = host_pool
        self.state_slots = state_slots
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_cache_hit_blocks = 0  # statistics: blocks reused through the prefix cache
        self.num_host_hit_blocks = 0  # of those, loaded from the host pool
        self.num_offloaded_blocks = 0  # statistics: blocks of running sequences moved to the host pool

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _full_block_hashes(self, seq: Sequence) -> list[int]:
        """Extend seq.block_hashes to every full block of its tokens and return it."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return seq.block_hashes

    def find_cached_blocks(self, seq: Sequence, device_after_host: bool = False) -> PrefixHit:
        """The longest run of cached blocks at the start of seq (on the device, then in the host pool, then with
        device_after_host on the device again: a long sequence's blocks, its tail kept on the device), leaving at
        least its last token to compute (that token's logits are needed)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return hit
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        for i, h in enumerate(self._full_block_hashes(seq)[:max_blocks]):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_id = self.cached.get(h)
            on_device = block_id is not None and self.blocks[block_id].token_ids == tokens
            if on_device and not hit.host_hashes:
                hit.device_blocks.append(block_id)
            elif on_device and device_after_host:
                hit.device_after.append(block_id)
            elif not hit.device_after and self.host_pool is not None and self.host_pool.find_prefix(h, tokens):
                hit.host_hashes.append(h)
            else:
                break
        return hit

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make seq's block table cover its computed tokens plus num_new_tokens, taking a prefix hit's blocks
        first (only for a sequence with no blocks yet; host ones are loaded into new blocks). False, and no
        change, if it can't."""
        hit = hit or PrefixHit()
        need_total = -(-(seq.num_computed_tokens + hit.num_blocks * self.block_size + num_new_tokens)
                       // self.block_size)
        num_new_blocks = need_total - len(seq.block_table) - len(hit.device_blocks)
        revived = sum(1 for b in hit.device_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + revived > len(self.free_queue):
            return False
        self._take_cached(seq, hit.device_blocks)
        # the host hits leave the pool's eviction order while device blocks are taken: evicting those stores
        # their KV in the pool, which must not push the hits out
        held = self.host_pool.checkout(hit.host_hashes) if hit.host_hashes else []
        new_blocks = [self._take_free_block() for _ in range(max(num_new_blocks, 0))]
        if held:
            self.host_pool.load_prefix(held, new_blocks[:len(held)])
        seq.block_table += new_blocks
        if self.state_slots is not None:
            self.state_slots.take(seq)
        self.num_cache_hit_blocks += hit.num_blocks
        self.num_host_hit_blocks += len(hit.host_hashes)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache (its KV kept in the host pool)
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                if self.host_pool is not None:
                    self.host_pool.store_prefix(block.block_hash, block.token_ids, block_id)
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def offload(self, seq: Sequence, num_blocks: int) -> int:
        """Move up to num_blocks of seq's leading device blocks to the host pool (its computed, full blocks that no
        other sequence shares), freeing them on the device; block_table marks them -1. Returns how many moved."""
        if self.host_pool is None:
            return 0
        first = len(seq.host_blocks)
        last = first
        while (last < min(seq.num_computed_tokens // self.block_size, first + num_blocks)
               and self.blocks[seq.block_table[last]].ref_count == 1):
            last += 1
        device_blocks = seq.block_table[first:last]
        pool_blocks = self.host_pool.swap_out(device_blocks) if device_blocks else None
        if pool_blocks is None:
            return 0
        seq.host_blocks += pool_blocks
        self.num_offloaded_blocks += len(pool_blocks)
        for i, block_id in enumerate(device_blocks, start=first):
            self.blocks[block_id].ref_count = 0
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)  # its KV is in the pool: the first to be reused
            seq.block_table[i] = -1
        return len(device_blocks)

    def resume_offloaded(self, seq: Sequence, num_new_tokens: int) -> int:
        """A swapped-out sequence taken back as an offloaded one: its full swapped blocks become its host blocks
        (block_table -1), a part-filled last one is copied back into a device block, and device blocks are taken for
        as many of num_new_tokens as they hold. Returns how many tokens fit (0, and no change, where none does)."""
        bs, computed = self.block_size, seq.num_computed_tokens
        num_full = computed // bs
        fit = min(num_new_tokens, self.num_free_blocks * bs - computed % bs)
        if fit <= 0:
            return 0
        device_blocks = [self._take_free_block() for _ in range(-(-(computed + fit) // bs) - num_full)]
        host_blocks, partial = seq.swapped_blocks[:num_full], seq.swapped_blocks[num_full:]
        if partial:
            self.host_pool.swap_in(partial, device_blocks[:1])
        seq.host_blocks = host_blocks
        seq.block_table = [-1] * num_full + device_blocks
        self.num_offloaded_blocks += num_full
        return fit

    def place_prefill_in_pool(self, seq: Sequence, hit: PrefixHit | None = None) -> bool:
        """For a prompt prefilled a layer at a time in one step (kvcache/layer_major.py): seq's computed KV in the host
        pool (its device blocks moved there; for a new sequence, a prefix hit's device blocks copied there and the
        pool's own hit blocks taken as they are), and blocks for the rest of its tokens taken there too, but for the
        tail that the device's free blocks hold. False, and nothing changed, where that cannot be: computed tokens
        ending mid-block or in blocks other sequences share, or the pool too full."""
        bs, hit = self.block_size, hit or PrefixHit()
        resident = seq.block_table[len(seq.host_blocks):]  # computed blocks still on the device: they move
        device_hits = hit.device_blocks + hit.device_after
        computed = seq.num_computed_tokens + hit.num_blocks * bs
        if self.host_pool is None or seq.num_computed_tokens % bs or (hit.num_blocks and seq.block_table) or \
                len(seq.block_table) != seq.num_computed_tokens // bs or \
                any(self.blocks[b].ref_count != 1 for b in resident) or any(self.blocks[b].ref_count for b in device_hits):
            return False
        new_blocks = -(-seq.num_tokens // bs) - computed // bs
        on_device = min(self.num_free_blocks + len(resident), new_blocks)
        moved = len(resident) + len(device_hits)
        if on_device < 1 or moved + new_blocks - on_device > self.host_pool.num_free_blocks - len(hit.host_hashes):
            return False
        held = self.host_pool.checkout(hit.host_hashes)  # first: the copies below must not evict them
        self._move_hit_to_pool(seq, hit.device_blocks, len(resident))
        seq.host_blocks += self.host_pool.adopt(held)
        seq.block_table += [-1] * len(held)
        seq.num_computed_tokens += len(held) * bs
        self._move_hit_to_pool(seq, hit.device_after)
        pool_blocks = self.host_pool.take(new_blocks - on_device)
        seq.host_blocks += pool_blocks
        seq.block_table += [-1] * len(pool_blocks) + [self._take_free_block() for _ in range(on_device)]
        if hit.num_blocks:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.num_cache_hit_blocks += hit.num_blocks
        self.num_host_hit_blocks += len(hit.host_hashes)
        self.num_offloaded_blocks += len(pool_blocks)
        return True

    def _take_cached(self, seq: Sequence, block_ids: list[int]):
        """Cached device blocks (a prefix hit) appended to seq's block table, referenced once more."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)

    def _move_hit_to_pool(self, seq: Sequence, device_blocks: list[int], resident: int = 0):
        """Cached device blocks taken as seq's next computed blocks, then copied to the pool with its `resident` device
        blocks before them."""
        self._take_cached(seq, device_blocks)
        seq.num_computed_tokens += len(device_blocks) * self.block_size
        assert self.offload(seq, resident + len(device_blocks)) == resident + len(device_blocks)

    def free(self, seq: Sequence):
        """Drop seq's references; its tail blocks become the first to be evicted. Its pool blocks that hold full,
        computed blocks stay in the pool's prefix cache, where a later prompt with that prefix finds them."""
        if self.state_slots is not None:
            self.state_slots.release(seq)
        offloaded = len(seq.host_blocks)
        if offloaded:
            kept = min(offloaded, seq.num_computed_tokens // self.block_size) if self.enable_prefix_caching else 0
            hashes, bs = self._full_block_hashes(seq), self.block_size
            self.host_pool.keep([(hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]), seq.host_blocks[i])
                                 for i in range(kept)])
            self.host_pool.release(seq.host_blocks[kept:])
            seq.host_blocks = []
        for block_id in reversed(seq.block_table[offloaded:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache): False, and nothing changed, while a
        sequence still holds blocks."""
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.cached.clear()
        if self.host_pool is not None:
            self.host_pool.reset_prefix_cache()
        return True

    def cache_full_blocks(self, seq: Sequence):
        """Register the blocks that seq's computed tokens have filled, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        hashes = self._full_block_hashes(seq)
        for i in range(max(seq.num_registered_blocks, len(seq.host_blocks)), num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:  # a prefix hit, already registered
                continue
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.cached.setdefault(block.block_hash, block.block_id)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
