"""Decode steps captured as CUDA graphs, one per batch-size bucket, sharing one memory pool.

A replay copies the step's inputs into static buffers; rows past the real batch are padding that attend
to one token in a scratch KV block, so they stay finite and touch no sequence's cache."""
import torch

from nanovllm.attention.metadata import AttentionMetadata


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch-size buckets: powers of two to 8, then every multiple of 16, then max_batch."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if b <= max_batch} | {max_batch})


class CUDAGraphRunner:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, max_model_len: int, block_size: int,
                 scratch_block: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.max_model_len = max_model_len
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.batch_sizes = graph_batch_sizes(max_batch)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, **i64)
        self.seq_lens = torch.ones(max_batch, **i32)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), scratch_block, **i32)
        self.query_start_loc = torch.arange(max_batch + 1, **i32)
        self.hidden = torch.empty(max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs, max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_cpu=None, seq_lens_cpu=None)

    @torch.inference_mode()
    def capture(self):
        pool = None
        for bs in reversed(self.batch_sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            self.hidden[:bs] = self.model(*args)  # warm-up: compiles kernels, sizes workspaces
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(self.scratch_slot)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[n:bs, 0].fill_(self.scratch_block)
        self.graphs[bs].replay()
        return self.hidden[:n]
