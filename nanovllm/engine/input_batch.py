"""A step's inputs on the device: token ids, positions and the attention metadata of the scheduled sequences, in one
host-to-device copy; and the steady decode batch, whose next inputs stay on the device."""
import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.attention.metadata import prefill_tile_tokens, prefill_tiles
from nanovllm.device_arrays import to_device
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplingTensors

ALIGN = 16  # int32 elements: 64 bytes


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prepare_inputs(seqs: list[Sequence], block_size: int, gqa_group: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) of the scheduled tokens of seqs (decodes first)."""
    bs = block_size
    num_new = [s.num_scheduled_tokens for s in seqs]
    starts = [0, *itertools.accumulate(num_new)]
    n, b, max_query_len = starts[-1], len(seqs), max(num_new)
    width = round_up(max(len(s.block_table) for s in seqs), ALIGN)
    tiles = prefill_tiles(num_new, prefill_tile_tokens(gqa_group)) if max_query_len > 1 else None
    # One host-to-device copy for the whole step's integers, cut into views on the device. Every view starts 64-byte
    # aligned and the 2-D views' row strides are multiples of 16, so the Triton kernels, which specialize on pointer
    # alignment and stride divisibility, never compile a variant mid-run.
    n_pad, b_pad = round_up(n, ALIGN // 2), round_up(b + 1, ALIGN)
    t_pad = round_up(tiles.shape[1], ALIGN) if tiles is not None else 0
    host = np.zeros(3 * n_pad + 2 * b_pad + b * width + 2 * t_pad, dtype=np.int64)
    ids, positions, slots = host[:n], host[n_pad:n_pad + n], host[2 * n_pad:2 * n_pad + n]
    small = host[3 * n_pad:]
    tables = small[2 * b_pad:2 * b_pad + b * width].reshape(b, width)
    seq_lens = []
    offloaded = [s.host_blocks for s in seqs] if any(s.host_blocks for s in seqs) else None
    for i, seq in enumerate(seqs):
        start, end, at = seq.num_computed_tokens, seq.num_computed_tokens + num_new[i], starts[i]
        table = seq.block_table
        if end - start == 1:  # decode: scalar writes, no per-sequence arrays (this loop runs for every sequence)
            ids[at], positions[at], slots[at] = seq.token_ids[start], start, table[start // bs] * bs + start % bs
        else:
            pos = np.arange(start, end)
            ids[at:at + end - start] = seq.token_ids[start:end]
            positions[at:at + end - start] = pos
            slots[at:at + end - start] = np.asarray(table)[pos // bs] * bs + pos % bs
        tables[i, :len(table)] = table
        seq_lens.append(end)
    small[:b + 1], small[b_pad:b_pad + b] = starts, seq_lens
    if tiles is not None:
        tile_rows = small[2 * b_pad + b * width:].reshape(2, t_pad)
        tile_rows[:] = -1
        tile_rows[:, :tiles.shape[1]] = tiles
    packed = to_device(host, torch.int64, device)
    small = packed[3 * n_pad:].to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=packed[2 * n_pad:2 * n_pad + n], query_start_loc=small[:b + 1],
        seq_lens=small[b_pad:b_pad + b], block_tables=small[2 * b_pad:2 * b_pad + b * width].view(b, width),
        num_decodes=num_new.count(1), max_query_len=max_query_len, max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        prefill_tiles=small[2 * b_pad + b * width:].view(2, t_pad) if tiles is not None else None,
        offloaded=offloaded)
    if seqs[0].state_slot is not None:
        meta.state_slots = [s.state_slot for s in seqs]
        meta.state_slot_ids = to_device(meta.state_slots, torch.int32, device)
    return packed[:n], packed[n_pad:n_pad + n], meta


@dataclass
class SteadyDecode:
    """The batch of the last decode step whose graphs left its next inputs on the device: launching the same
    sequences again needs only the KV blocks they took since (each row's block count there is known_blocks)."""

    seqs: list[Sequence]
    known_blocks: list[int]
    max_seq_len: int  # the step's longest context (the decode graph that runs it)
    sampling: SamplingTensors | None = None  # top-k / top-p / min-p: the eager sampler's knobs (None: the graph's)

    def continues(self, seqs: list[Sequence]) -> bool:
        """seqs is this batch again, each with one new token (decodes come first: the last one tells)."""
        return (len(seqs) == len(self.seqs) and seqs[-1].num_scheduled_tokens == 1
                and all(map(operator.is_, seqs, self.seqs)) and not any(s.host_blocks for s in seqs))

    def new_blocks(self) -> list[tuple[int, int, int]]:
        """(row, column, block id) of every block table entry the device does not hold yet; now it will."""
        entries = []
        for row, seq in enumerate(self.seqs):
            table, known = seq.block_table, self.known_blocks[row]
            if len(table) > known:
                entries += [(row, col, table[col]) for col in range(known, len(table))]
                self.known_blocks[row] = len(table)
        return entries
