"""A decode batch's inputs kept on the device from one step to the next (engine.cuda_graph's steady decode).

The state of a row is its next input token and that token's position; its block table lives beside them.
`prepare_decode_inputs`, the first kernel of a decode graph, derives each row's KV slot and context length from
them (and, given the embedding table, gathers the rows' input embeddings in the same launch: a kernel fewer on
the step's dependent chain); `advance_decode_inputs`, the last kernel of a sampling graph, makes the sampled
tokens the next input ids and moves positions and sampling steps on by one. Rows at or past num_rows (a device
scalar) are the bucket's padding: position 0 in the scratch block.
With a token ring (pinned host memory, [ring rows, max rows]), the advance kernel also writes the tokens into the
ring row that the prepare kernel of the same step picked (step count modulo ring rows, counted on the device in
ring_state = [steps, this step's row]): the host reads them there, with no copy of its own to wait for (on the H100
a bs=1 step's device-to-host copy and the gaps around it took ~8 us of a ~690 us step).
References: the *_reference functions below."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.embedding import embed_row
from nanovllm.kernels.pdl import pdl_launch, wait_then_release

ROWS_PER_PROGRAM = 128


@triton.jit(do_not_specialize=["rows", "scratch_block"])
def _prepare_kernel(positions_ptr, seq_lens_ptr, slot_ptr, block_tables_ptr, table_stride, num_rows_ptr, rows,
                    scratch_block, ring_state_ptr, ids_ptr, embed_ptr, hidden_ptr, hidden, RING_ROWS: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, EMBED_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p prepares rows [p * BLOCK, + BLOCK) (none past the bucket) and, with EMBED_BLOCK, embeds row
    p - cdiv(rows, BLOCK) (none before the first such program)."""
    wait_then_release(PDL)
    if EMBED_BLOCK > 0:
        embedded = tl.program_id(0) - tl.cdiv(rows, BLOCK)
        embed_row(ids_ptr, embed_ptr, hidden_ptr, tl.maximum(embedded, 0), tl.arange(0, EMBED_BLOCK), hidden,
                  tl.where(embedded >= 0, hidden, 0))
    if RING_ROWS > 0 and tl.program_id(0) == 0:
        count = tl.load(ring_state_ptr)
        tl.store(ring_state_ptr + 1, count % RING_ROWS)
        tl.store(ring_state_ptr, count + 1)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bucket = row < rows
    real = row < tl.load(num_rows_ptr)
    pos = tl.load(positions_ptr + row, mask=real, other=0)
    table = block_tables_ptr + row.to(tl.int64) * table_stride
    tl.store(table, scratch_block, mask=in_bucket & ~real)
    block = tl.load(table + pos // BLOCK_SIZE, mask=real, other=scratch_block).to(tl.int64)
    tl.store(positions_ptr + row, pos, mask=in_bucket)
    tl.store(seq_lens_ptr + row, (pos + 1).to(tl.int32), mask=in_bucket)
    tl.store(slot_ptr + row, block * BLOCK_SIZE + pos % BLOCK_SIZE, mask=in_bucket)


@triton.jit(do_not_specialize=["rows"])
def _advance_kernel(tokens_ptr, input_ids_ptr, positions_ptr, steps_ptr, num_rows_ptr, rows, ring_ptr, ring_stride,
                    ring_state_ptr, RING: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    real = (row < rows) & (row < tl.load(num_rows_ptr))
    tokens = tl.load(tokens_ptr + row, mask=real)
    tl.store(input_ids_ptr + row, tokens, mask=real)
    if RING:
        tl.store(ring_ptr + tl.load(ring_state_ptr + 1) * ring_stride + row, tokens, mask=real)
    tl.store(positions_ptr + row, tl.load(positions_ptr + row, mask=real) + 1, mask=real)
    tl.store(steps_ptr + row, tl.load(steps_ptr + row, mask=real) + 1, mask=real)


def prepare_decode_inputs(positions: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, num_rows: torch.Tensor, scratch_block: int, block_size: int,
                          ring_state: torch.Tensor | None = None, ring_rows: int = 0,
                          input_ids: torch.Tensor | None = None,
                          embedding: torch.Tensor | None = None) -> torch.Tensor | None:
    """In place, for the rows of a bucket ([R] int64 positions and slots, [R] int32 seq_lens, [R, W] int32 block
    tables, num_rows a [1] int32): slots and context lengths from positions; padding rows reset. With ring_state
    ([2] int32) and ring_rows: this step's ring row, and the step counted. With input_ids [R] and the embedding
    table [vocab, hidden] (contiguous): returns the rows' embeddings [R, hidden], else None."""
    rows = positions.shape[0]
    assert block_tables.stride(1) == 1
    hidden, embed_args, embed_block = None, (positions, positions, positions, 0), 0  # no gather: unused pointers
    if embedding is not None:
        assert embedding.is_contiguous() and input_ids.shape == (rows,)
        hidden = torch.empty(rows, embedding.shape[1], dtype=embedding.dtype, device=embedding.device)
        embed_args, embed_block = (input_ids, embedding, hidden, hidden.shape[1]), triton.next_power_of_2(hidden.shape[1])
    _prepare_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM) + (rows if hidden is not None else 0),)](
        positions, seq_lens, slot_mapping, block_tables, block_tables.stride(0), num_rows, rows, scratch_block,
        ring_state if ring_rows else num_rows, *embed_args, RING_ROWS=ring_rows, BLOCK_SIZE=block_size,
        BLOCK=ROWS_PER_PROGRAM, EMBED_BLOCK=embed_block, **pdl_launch(positions.device))
    return hidden


def advance_decode_inputs(tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                          steps: torch.Tensor, num_rows: torch.Tensor, ring: torch.Tensor | None = None,
                          ring_state: torch.Tensor | None = None):
    """In place, for the first num_rows rows: the sampled tokens become the input ids, positions and steps + 1;
    with ring ([ring rows, >= R] int64, pinned host memory on CUDA) and ring_state, also ring[ring_state[1]]."""
    rows = tokens.shape[0]
    has_ring = ring is not None
    assert not has_ring or (ring.stride(1) == 1 and ring.dtype == tokens.dtype and ring.shape[1] >= rows)
    _advance_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        tokens, input_ids, positions, steps, num_rows, rows, ring if has_ring else tokens,
        ring.stride(0) if has_ring else 0, ring_state if has_ring else num_rows, RING=has_ring,
        BLOCK=ROWS_PER_PROGRAM, **pdl_launch(tokens.device))


def prepare_decode_inputs_reference(positions, seq_lens, slot_mapping, block_tables, num_rows: int,
                                    scratch_block: int, block_size: int, ring_state=None, ring_rows: int = 0,
                                    input_ids=None, embedding=None):
    hidden = None if embedding is None else torch.nn.functional.embedding(input_ids, embedding)
    if ring_rows:
        ring_state[1] = ring_state[0] % ring_rows
        ring_state[0] += 1
    positions[num_rows:] = 0
    block_tables[num_rows:, 0] = scratch_block
    blocks = block_tables.gather(1, (positions // block_size)[:, None])[:, 0].long()
    slot_mapping.copy_(blocks * block_size + positions % block_size)
    seq_lens.copy_(positions + 1)
    return hidden


def advance_decode_inputs_reference(tokens, input_ids, positions, steps, num_rows: int, ring=None, ring_state=None):
    if ring is not None:
        ring[ring_state[1], :num_rows] = tokens[:num_rows]
    input_ids[:num_rows] = tokens[:num_rows]
    positions[:num_rows] += 1
    steps[:num_rows] += 1
