"""Attention over KV blocks held in the host pool (kvcache/host_pool.py), streamed through a ring of GPU slots.

Each slot holds `slot_blocks` blocks of one layer (K and V). For a sequence whose context blocks are in the pool,
attend() attends to them a slot at a time as they land and merges the parts by their log-sum-exp
(attention/merge.py). The loads run ahead in the order the parts are read (plan(): a step's every layer and
sequence), so that while slot k is attended to the next slots fill, across layers. On CUDA each slot has its own
transfer stream and two events: "loaded" (the compute stream waits on it before attending) and "consumed" (the
transfer stream waits on it before it overwrites the slot); copies go by sgDMA. On CPU the slots are host tensors
and the copies run in order: the same code and bookkeeping, tested in CI.

forward() is a step's attention where some sequence has offloaded blocks (the scheduler moves a sequence's leading
blocks to the pool when the GPU runs out, engine/block_manager.offload): per sequence, its resident blocks from the
device cache and its offloaded ones through the ring, merged. Decoding sequences whose offloaded blocks fit a slot
together share it (a PackedGroup): one load, one attention launch and one merge a layer for all of them, since the
host's work a part, not the link, bounds a step of many short offloaded contexts. It runs eagerly. With `fast` (the
Triton kernels on CUDA) the rows attend to their resident blocks by the paged decode (decode rows) and the causal
paged prefill (prompt chunks), and to each slot by the paged decode (decode rows) or torch's flash attention (prompt
chunks), each giving its log-sum-exp; a sequence's parts merge once a layer in one kernel
(kernels/merge_attention.py), and the new K/V are stored by the Triton store. Without it, plain torch
(attention/merge.py, the twin)."""
from collections import deque
from dataclasses import dataclass

import torch

from nanovllm.attention.merge import attention_with_lse, fused_attention_with_lse, merge_parts
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import store_kv_reference
from nanovllm.comm.sgdma import copy_blocks

OFFLOAD_SLOTS = 3  # slots loading while one is attended to
# the KV bytes a slot holds (of one layer): the link waits while the host launches a part's work, so fewer, larger
# parts keep it busier (H100, Qwen3-0.6B shape at 32K, decode ms a step: 16 MiB 110-200, 64 MiB 85-130, 128 MiB
# 67-89 against the link's 65)
OFFLOAD_SLOT_BYTES = 128 << 20
PAGED_DECODE_ROWS = 8  # a sequence's rows that attend to a slot by the paged decode; more (a prompt chunk) go by
# torch's fused attention, whose query tiles share each key tile (the decode kernel reads the slot once a row)


def slot_splits(tokens: int) -> int:
    """Splits of a slot's keys in the paged decode: a slot is a long context for a few rows, so more splits keep the
    SMs busy."""
    return min(32, max(2, 1 << (tokens // 1024).bit_length()))


def split_lengths(capacity: int) -> list[int]:
    """A slot length for each split count that slots of up to `capacity` tokens take."""
    return sorted({min(capacity, 1024 << i) for i in range(5)})


def slot_blocks(pool: torch.Tensor) -> int:
    """Blocks of one layer (K and V) that fill OFFLOAD_SLOT_BYTES, or the whole pool where it is smaller."""
    return max(1, min(pool.shape[2], OFFLOAD_SLOT_BYTES // (pool[:, 0, 0].numel() * pool.element_size())))


@dataclass
class PackedGroup:
    """Decode rows first..last-1 (one a sequence) whose offloaded blocks are loaded into one slot, one after another:
    row r reads slot blocks tables[r] for lens[r] tokens."""

    first: int
    last: int
    blocks: list[int]  # the pool blocks, in slot order
    tables: torch.Tensor  # [rows, widest] int32, slot block indices
    lens: torch.Tensor  # [rows] int32
    tokens: int  # the longest row's


def pack_decodes(offloaded: list[list[int]], num_decodes: int, slot_blocks: int) -> list[tuple[int, int]]:
    """Runs (first, last) of consecutive decode sequences whose offloaded blocks fill one slot together at most."""
    runs, first, held = [], None, 0
    for i in range(num_decodes):
        n = len(offloaded[i])
        if first is not None and (n == 0 or n > slot_blocks or held + n > slot_blocks):
            runs.append((first, i))
            first = None
        if first is None and 0 < n <= slot_blocks:
            first, held = i, 0
        held += n
    if first is not None:
        runs.append((first, num_decodes))
    return runs


class OffloadEngine:

    def __init__(self, pool: torch.Tensor, num_slots: int, slot_blocks: int, device: torch.device,
                 fast: bool = False):
        """pool: the host KV blocks [2, layers, blocks, block_size, kv_heads, head_dim]; fast: attend with the
        Triton paged decode kernel (kernels/paged_attention.py) instead of plain torch."""
        if num_slots < 1 or slot_blocks < 1:
            raise ValueError(f"an offload ring needs at least one slot of one block, not {num_slots} x {slot_blocks}")
        self.pool, self.num_slots, self.slot_blocks, self.fast = pool, num_slots, slot_blocks, fast
        self.block_size = pool.shape[3]
        self.slots = torch.empty((num_slots, 2, 1, slot_blocks, *pool.shape[3:]), dtype=pool.dtype, device=device)
        self.streams = self.loaded = self.consumed = None
        self.slot_tables = torch.arange(slot_blocks, dtype=torch.int32, device=device)[None, :]
        self.slot_lens: dict[tuple[int, int], torch.Tensor] = {}  # (rows, tokens) -> lens, for the current step
        self.pending: deque[tuple[int, list[int]]] = deque()  # (layer, blocks) parts planned, not loading yet
        self.in_ring: deque[tuple[int, int, list[int]]] = deque()  # (slot, layer, blocks) loading or loaded
        self.next_slot = 0
        if device.type == "cuda":
            self.streams = [torch.cuda.Stream(device) for _ in range(num_slots)]
            self.loaded = [torch.cuda.Event() for _ in range(num_slots)]
            self.consumed = [torch.cuda.Event() for _ in range(num_slots)]

    def _load(self, slot: int, layer: int, blocks: list[int]):
        """Pool blocks of one layer into a slot, once the slot's last part has been attended to."""
        source, target = self.pool[:, layer:layer + 1], self.slots[slot]
        if self.streams is None:
            copy_blocks(source, target, blocks, list(range(len(blocks))))
            return
        stream = self.streams[slot]
        stream.wait_event(self.consumed[slot])
        with torch.cuda.stream(stream):
            copy_blocks(source, target, blocks, list(range(len(blocks))))
            self.loaded[slot].record(stream)

    def parts(self, blocks: list[int]) -> list[list[int]]:
        return [blocks[i:i + self.slot_blocks] for i in range(0, len(blocks), self.slot_blocks)]

    def plan(self, loads: list[tuple[int, list[int]]]):
        """The (layer, blocks) parts that the next attend() calls read, in their order; loading starts now."""
        self.pending, self.in_ring, self.slot_lens = deque(loads), deque(), {}
        self._fill()

    def _fill(self):
        while self.pending and len(self.in_ring) < self.num_slots:
            layer, blocks = self.pending.popleft()
            slot, self.next_slot = self.next_slot, (self.next_slot + 1) % self.num_slots
            self._load(slot, layer, blocks)
            self.in_ring.append((slot, layer, blocks))

    def attend(self, layer: int, q: torch.Tensor, blocks: list[int], length: int, scale: float,
               resident: tuple[torch.Tensor, torch.Tensor] | None = None, out: torch.Tensor | None = None):
        """q [Lq, H, D] against the first `length` tokens held in pool blocks `blocks` of this layer, every token
        visible to every query -> (out [Lq, H, D], lse [Lq, H]), merged with `resident` (the same rows' (out, lse)
        over their GPU-resident keys) where given. The output goes into `out` (any float dtype) where given, else
        into a new fp32 tensor; lse is fp32. Parts not planned are loaded now."""
        if length <= 0 or -(-length // self.block_size) != len(blocks):
            raise ValueError(f"{length} tokens are not held by {len(blocks)} blocks of {self.block_size}")
        parts = self.parts(blocks)
        if not self.in_ring or self.in_ring[0][1:] != (layer, parts[0]):
            self.plan([(layer, part) for part in parts])
        count = len(parts) + (resident is not None)
        outs = torch.empty((count, *q.shape), dtype=torch.float32, device=q.device)
        lses = torch.empty((count, *q.shape[:2]), dtype=torch.float32, device=q.device)
        for j, part in enumerate(parts):
            slot = self._take_slot(layer, part)
            tokens = min(length - j * self.slot_blocks * self.block_size, len(part) * self.block_size)
            self._attend_slot(q, slot, len(part), tokens, scale, outs[j], lses[j])
            self._release_slot(slot)
        if resident is not None:
            outs[-1], lses[-1] = resident
        return self._merge(outs, lses, out)

    def _take_slot(self, layer: int, blocks: list[int]) -> int:
        """The ring's next slot, which must hold these blocks of this layer, once loaded."""
        slot, *planned = self.in_ring.popleft()
        assert planned == [layer, blocks], "attend() calls left the planned order"
        if self.streams is not None:
            torch.cuda.current_stream().wait_event(self.loaded[slot])
        return slot

    def _release_slot(self, slot: int):
        """The slot attended to: it may load the next planned part."""
        if self.streams is not None:
            self.consumed[slot].record()
        self._fill()

    def _merge(self, outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor | None):
        if self.fast:  # one kernel instead of the twin's ~10 eager ops a layer
            from nanovllm.kernels.merge_attention import merge_parts_fused

            out = torch.empty(outs.shape[1:], dtype=torch.float32, device=outs.device) if out is None else out
            lse = torch.empty(outs.shape[1:3], dtype=torch.float32, device=outs.device)
            return merge_parts_fused(outs, lses, out, lse), lse
        merged, lse = merge_parts(outs, lses)
        return (merged if out is None else out.copy_(merged)), lse

    def _groups(self, meta: AttentionMetadata, device) -> tuple[list[PackedGroup], dict[int, PackedGroup]]:
        """The step's packed groups (computed at the first layer, kept in meta.scratch), and each by its first row."""
        if "offload_groups" not in meta.scratch:
            groups = []
            for first, last in pack_decodes(meta.offloaded, meta.num_decodes, self.slot_blocks):
                counts = [len(b) for b in meta.offloaded[first:last]]
                starts = [sum(counts[:r]) for r in range(len(counts))]
                tables = torch.tensor([[min(st + j, st + n - 1) for j in range(max(counts))]
                                       for st, n in zip(starts, counts)], dtype=torch.int32)
                groups.append(PackedGroup(first, last, [b for blocks in meta.offloaded[first:last] for b in blocks],
                                          tables.to(device), torch.tensor(counts, dtype=torch.int32).mul_(
                                              self.block_size).to(device), max(counts) * self.block_size))
            meta.scratch["offload_groups"] = groups, {g.first: g for g in groups}
        return meta.scratch["offload_groups"]

    def _attend_packed(self, layer: int, q: torch.Tensor, group: PackedGroup, scale: float,
                       resident: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor):
        """The group's rows against their blocks in the slot they share, merged with their resident parts into out."""
        slot = self._take_slot(layer, group.blocks)
        rows = q[group.first:group.last]
        outs = torch.empty((2, *rows.shape), dtype=torch.float32, device=q.device)
        lses = torch.empty((2, *rows.shape[:2]), dtype=torch.float32, device=q.device)
        k_slot, v_slot = self.slots[slot, 0, 0], self.slots[slot, 1, 0]
        if self.fast:
            from nanovllm.kernels.paged_attention import paged_decode

            paged_decode(rows, k_slot, v_slot, group.tables, group.lens, scale, slot_splits(group.tokens),
                         out=outs[0], lse=lses[0])
        else:
            for r in range(rows.shape[0]):
                table = group.tables[r, :-(-int(group.lens[r]) // self.block_size)].long()
                outs[0, r:r + 1], lses[0, r:r + 1] = attention_with_lse(
                    rows[r:r + 1], k_slot[table].flatten(0, 1), v_slot[table].flatten(0, 1), scale)
        self._release_slot(slot)
        outs[1], lses[1] = resident
        self._merge(outs, lses, out[group.first:group.last])

    def _attend_slot(self, q: torch.Tensor, slot: int, num_blocks: int, tokens: int, scale: float,
                     out: torch.Tensor, lse: torch.Tensor):
        """Every row of q against the first `tokens` keys of a slot, into out and lse (fp32)."""
        k_slot, v_slot = self.slots[slot, 0, 0], self.slots[slot, 1, 0]  # [slot_blocks, block_size, kv_heads, D]
        rows = q.shape[0]
        if not self.fast or (q.is_cuda and rows > PAGED_DECODE_ROWS):
            attend = attention_with_lse if not self.fast else fused_attention_with_lse
            out[:], lse[:] = attend(q, k_slot[:num_blocks].flatten(0, 1)[:tokens],
                                    v_slot[:num_blocks].flatten(0, 1)[:tokens], scale)
            return
        from nanovllm.kernels.paged_attention import paged_decode

        if (rows, tokens) not in self.slot_lens:
            self.slot_lens[rows, tokens] = torch.full((rows,), tokens, dtype=torch.int32, device=q.device)
        paged_decode(q, k_slot, v_slot, self.slot_tables.expand(rows, -1), self.slot_lens[rows, tokens], scale,
                     slot_splits(tokens), out=out, lse=lse)

    def warm_up(self, num_heads: int):
        """Compile the paged decode over a slot for every split count now: Triton compiles each on first use, and
        the first long decode would pay ~1 s for it (a 32K decode measured 81% of its bound in a run that did)."""
        if not self.fast or self.streams is None:
            return
        q = torch.zeros((1, num_heads, self.slots.shape[-1]), dtype=self.slots.dtype, device=self.slots.device)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty((1, num_heads), dtype=torch.float32, device=q.device)
        for tokens in split_lengths(self.slot_blocks * self.block_size):
            self._attend_slot(q, 0, -(-tokens // self.block_size), tokens, 1.0, out, lse)
        self.slot_lens = {}

    def _resident_tables(self, meta: AttentionMetadata, first: int, last: int, device):
        """Block tables and context lengths of sequences first..last-1 past their offloaded blocks. The positions
        of keys and queries both shift by the offloaded tokens, so the kernels' causal masks hold."""
        offloaded = torch.tensor([len(b) for b in meta.offloaded[first:last]], dtype=torch.int32)
        width = meta.block_tables.shape[1]
        columns = (torch.arange(width, dtype=torch.int32)[None, :] + offloaded[:, None]).clamp(max=width - 1)
        tables = meta.block_tables[first:last].gather(1, columns.to(device, torch.int64)).contiguous()
        return tables, meta.seq_lens[first:last] - (offloaded * self.block_size).to(device)

    def _resident_inputs(self, meta: AttentionMetadata, group: int, device) -> tuple:
        """The kernels' inputs for the resident blocks, the same for every layer of the step (computed at the first,
        kept in meta.scratch): the decode rows' (tables, lens), and the prompt chunks' (tables, lens, query starts,
        tiles) or None."""
        if "offload_resident" not in meta.scratch:
            from nanovllm.attention.metadata import prefill_tile_tokens, prefill_tiles

            nd, b, starts = meta.num_decodes, meta.num_seqs, meta.query_start_loc_cpu
            decodes = self._resident_tables(meta, 0, nd, device) if nd else None
            prefills = None
            if nd < b:
                query_start = torch.tensor([s - starts[nd] for s in starts[nd:]], dtype=torch.int32, device=device)
                tiles = prefill_tiles([starts[i + 1] - starts[i] for i in range(nd, b)], prefill_tile_tokens(group))
                prefills = (*self._resident_tables(meta, nd, b, device), query_start,
                            torch.from_numpy(tiles).to(device))
            meta.scratch["offload_resident"] = decodes, prefills
        return meta.scratch["offload_resident"]

    def _attend_resident(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """Every row against its sequence's resident blocks, by the Triton kernels (a paged decode for the decode
        rows, the causal paged prefill for prompt chunks) -> (out, lse), fp32."""
        from nanovllm.kernels.paged_attention import paged_decode, paged_prefill

        nd, starts = meta.num_decodes, meta.query_start_loc_cpu
        decodes, prefills = self._resident_inputs(meta, q.shape[1] // k_cache.shape[2], q.device)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # the kernels store in out's dtype
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if decodes is not None:
            paged_decode(q[:nd], k_cache, v_cache, *decodes, scale, 8, out=out[:nd], lse=lse[:nd])
        if prefills is not None:
            rows = slice(starts[nd], starts[meta.num_seqs])
            paged_prefill(q[rows], k_cache, v_cache, *prefills, scale, out=out[rows], lse=lse[rows])
        return out, lse

    def forward(self, layer: int, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A layer's attention for a step where meta.offloaded names host blocks: the new K/V stored, then each
        sequence's queries against its resident context (causal) merged with its offloaded prefix. A chunk of a
        prompt prefilled a layer at a time attends through its LayerMajorPrefill (kvcache/layer_major.py) instead."""
        if (layer_major := meta.scratch.get("layer_major")) is not None:
            return layer_major.attend(layer, q, k, v, meta, scale)
        groups, group_at = self._groups(meta, q.device)
        if layer == 0:  # the step's every offloaded part, layer by layer, in the order forward() reads them
            self.plan([(i, part) for i in range(self.pool.shape[1]) for part in self._step_parts(meta, group_at)])
        if self.fast:
            from nanovllm.kernels.kv_store import store_kv

            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            store_kv_reference(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        res_out, res_lse = (self._attend_resident if self.fast else self._attend_resident_twin)(
            q, k_cache, v_cache, meta, scale)
        i = 0
        while i < meta.num_seqs:
            if (group := group_at.get(i)) is not None:
                rows = slice(group.first, group.last)
                self._attend_packed(layer, q, group, scale, (res_out[rows], res_lse[rows]), out)
                i = group.last
                continue
            s, e, host_blocks = starts[i], starts[i + 1], meta.offloaded[i]
            if host_blocks:
                self.attend(layer, q[s:e], host_blocks, len(host_blocks) * self.block_size, scale,
                            resident=(res_out[s:e], res_lse[s:e]), out=out[s:e])
            else:
                out[s:e] = res_out[s:e]
            i += 1
        return out

    def _step_parts(self, meta: AttentionMetadata, group_at: dict[int, PackedGroup]) -> list[list[int]]:
        """A layer's parts in the order forward() reads them: a packed group's blocks at once, other sequences'
        blocks a slot at a time."""
        parts, i = [], 0
        while i < meta.num_seqs:
            if (group := group_at.get(i)) is not None:
                parts.append(group.blocks)
                i = group.last
                continue
            if meta.offloaded[i]:
                parts += self.parts(meta.offloaded[i])
            i += 1
        return parts

    def _attend_resident_twin(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """_attend_resident in plain torch: each sequence's rows against its resident blocks, causal -> (out, lse)."""
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        starts = meta.query_start_loc_cpu
        for i, (seq_len, host_blocks) in enumerate(zip(meta.seq_lens_cpu, meta.offloaded)):
            s, e = starts[i], starts[i + 1]
            host_tokens = len(host_blocks) * self.block_size
            table = meta.block_tables[i, len(host_blocks):-(-seq_len // self.block_size)].long()
            keys, values = (cache[table].flatten(0, 1)[:seq_len - host_tokens] for cache in (k_cache, v_cache))
            query_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device)
            key_pos = torch.arange(host_tokens, seq_len, device=q.device)
            out[s:e], lse[s:e] = attention_with_lse(q[s:e], keys, values, scale, key_pos[None, :] <= query_pos[:, None])
        return out, lse
