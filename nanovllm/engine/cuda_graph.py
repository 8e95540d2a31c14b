"""Steps captured as CUDA graphs, sharing one memory pool: decode steps per batch-size bucket and context bound
(their logits included, and a sampling graph per batch-size bucket; small buckets also one graph of both), and steps
with prefills per token-count bucket (up to the hidden states; the rows to sample vary). A decode step replays the
graph of the smallest context bound that holds its longest context (AttentionBackend.decode_context_bounds: the
attention kernels are planned for it), so the fast paths for short contexts do not depend on max_model_len.

A replay reads the step's inputs from static buffers: copied there from the host, or, for a decode batch that
runs again unchanged, left there by its previous step's sampling graph. Decode rows past the real batch are
padding that attend to one token in a scratch KV block, so they stay finite and touch no sequence's cache;
prefill tokens past the real ones store their K/V in that scratch block and belong to no attention tile."""
import torch

from nanovllm.attention.metadata import AttentionMetadata, prefill_tile_tokens
from nanovllm.distributed.parallel_state import broadcast
from nanovllm.engine.input_batch import ALIGN, round_up
from nanovllm.kernels.decode_inputs import advance_decode_inputs, prepare_decode_inputs
from nanovllm.kernels.sampling import gumbel_argmax
from nanovllm.logger import logger

TOKEN_RING_ROWS = 4  # > the steps in flight: the host reads a step's row before the step after the next is launched
# decode buckets up to this size also get one graph of the step and its sampling together (run_steady): one graph
# boundary a steady step instead of two, and the sampling kernels launch under PDL behind the LM head (on the H100
# a bs=1 step's sampling graph began ~3.4 us after the step graph's last kernel ended); a larger bucket's step is
# long enough that a boundary is lost in it, so it keeps two replays (four graphs more to capture, not twenty)
STEADY_GRAPH_MAX_BATCH = 8


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch-size buckets: powers of two to 8, then every multiple of 16, then max_batch."""
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if b <= max_batch} | {max_batch})


def prefill_graph_sizes(max_tokens: int, smallest: int = 256) -> list[int]:
    """The captured token-count buckets: powers of two from `smallest` to 2048, then every multiple of 2048,
    then max_tokens."""
    sizes = {smallest << i for i in range(8) if smallest << i <= min(2048, max_tokens)}
    return sorted(sizes | set(range(2048, max_tokens + 1, 2048)) | {max_tokens})


def max_prefill_tiles(tokens: int, max_seqs: int, tile_tokens: int) -> int:
    """Tiles of any batch of `tokens` tokens in at most max_seqs sequences: one partial tile per sequence at most
    beyond the full ones."""
    return -(-tokens // tile_tokens) + min(max_seqs, tokens)


def _capture(graphs: dict, sizes: list, step, pool):
    """Capture step(size) for each size (ascending), largest first (the smaller ones reuse its memory); return the
    pool."""
    for size in reversed(sizes):
        step(size)  # warm-up: compiles kernels, sizes workspaces
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step(size)
        pool = graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize()
    return pool


class _StepBuffers:
    """The static inputs a captured step reads: per token and per sequence."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, scratch_block: int, block_size: int,
                 device: torch.device):
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.full((max_tokens,), self.scratch_slot, **i64)
        self.seq_lens = torch.ones(max_seqs, **i32)
        self.block_tables = torch.full((max_seqs, max_blocks_per_seq), scratch_block, **i32)
        self.query_start_loc = torch.arange(max_seqs + 1, **i32)
        self.state_slots = torch.full((max_seqs,), -1, **i32)  # linear-attention layers' slots; padding rows -1

    def fill_tokens(self, input_ids, positions, slot_mapping, padded: int):
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:padded].fill_(self.scratch_slot)

    def fill_seqs(self, meta: AttentionMetadata):
        b, width = meta.num_seqs, meta.block_tables.shape[1]
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)


class CUDAGraphRunner:
    """Decode steps of up to max_batch sequences, replayed with their LM head: run() returns logits. Beside each
    step graph, a sampling graph draws the tokens (temperature-only batches, greedy rows included) and makes
    them the next step's inputs on the device (advance() does that after a sampler outside the graphs), so a batch
    that decodes again unchanged replays with nothing copied from the host but its new KV blocks (replay,
    run_steady). The step graph's first kernel derives the slots and context lengths from positions and block
    tables (kernels.decode_inputs)."""

    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, context_bounds, block_size: int,
                 scratch_block: int, vocab_size: int, dtype: torch.dtype, device: torch.device):
        """context_bounds(batch size) -> the context bounds its decode steps are captured for, ascending."""
        self.model = model
        self.block_size = block_size
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.context_bounds = {bs: context_bounds(bs) for bs in self.batch_sizes}
        self.buffers = _StepBuffers(max_batch, max_batch, max_blocks_per_seq, scratch_block, block_size, device)
        self.num_rows = torch.zeros(1, dtype=torch.int32, device=device)  # real rows of the batch in the buffers
        self.logits = torch.empty(max_batch, vocab_size, dtype=dtype, device=device)
        self.temperature = torch.zeros(max_batch, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.steps = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        # the sampled tokens of the last TOKEN_RING_ROWS steps, written there by the advance kernel for the host
        self.token_ring = torch.zeros(TOKEN_RING_ROWS, max_batch, dtype=torch.int64, pin_memory=True)
        self.ring_state = torch.zeros(2, dtype=torch.int32, device=device)  # steps counted, this step's ring row
        self.replays = 0  # step graphs replayed since capture: the host's count of ring_state[0]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # per (batch size, context bound)
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steady_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # the step graph, then the sampling's

    def _meta(self, bs: int, context_bound: int) -> AttentionMetadata:
        buf = self.buffers
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:bs], query_start_loc=buf.query_start_loc[:bs + 1],
            seq_lens=buf.seq_lens[:bs], block_tables=buf.block_tables[:bs], num_decodes=bs, max_query_len=1,
            max_seq_len=context_bound, query_start_loc_cpu=None, seq_lens_cpu=None,
            state_slot_ids=buf.state_slots[:bs])

    def _step(self, bs: int, context_bound: int):
        buf = self.buffers
        embeds = prepare_decode_inputs(buf.positions[:bs], buf.seq_lens[:bs], buf.slot_mapping[:bs],
                                       buf.block_tables[:bs], self.num_rows, buf.scratch_block, self.block_size,
                                       self.ring_state, TOKEN_RING_ROWS, buf.input_ids[:bs], self.model.embedding_table())
        hidden = self.model(buf.input_ids[:bs], buf.positions[:bs], self._meta(bs, context_bound), embeds)
        self.model.compute_logits(hidden, out=self.logits[:bs])

    def _sample_step(self, bs: int):
        gumbel_argmax(self.logits[:bs], self.seeds[:bs], self.steps[:bs], self.temperature[:bs],
                      out=self.tokens[:bs])
        broadcast(self.tokens[:bs])  # tensor parallel: every rank's next inputs are rank 0's tokens
        self.advance(self.tokens[:bs], self.steps[:bs])

    def _steady_step(self, bs: int, context_bound: int):
        self._step(bs, context_bound)
        self._sample_step(bs)

    @torch.inference_mode()
    def capture(self, pool=None):
        keys = [(bs, bound) for bs in self.batch_sizes for bound in self.context_bounds[bs]]
        pool = _capture(self.graphs, keys, lambda key: self._step(*key), pool)
        pool = _capture(self.sample_graphs, self.batch_sizes, self._sample_step, pool)
        steady_keys = [key for key in keys if key[0] <= STEADY_GRAPH_MAX_BATCH]
        pool = _capture(self.steady_graphs, steady_keys, lambda key: self._steady_step(*key), pool)
        self.ring_state.zero_()  # the warm-up steps counted
        torch.cuda.synchronize()
        return pool

    def graph_dicts(self) -> list[dict]:
        return [self.graphs, self.sample_graphs, self.steady_graphs]

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def _bucket(self, n: int) -> int:
        return next(b for b in self.batch_sizes if b >= n)

    def _key(self, n: int, max_seq_len: int) -> tuple[int, int]:
        """(batch-size bucket, context bound) of the graph that runs a decode step of n sequences whose longest
        context (this step's token included) is max_seq_len."""
        bs = self._bucket(n)
        return bs, next(b for b in self.context_bounds[bs] if b >= max_seq_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        buf = self.buffers
        buf.input_ids[:n].copy_(input_ids)
        buf.positions[:n].copy_(positions)
        buf.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if meta.state_slot_ids is not None:  # rows past n must touch no sequence's state
            buf.state_slots[:n].copy_(meta.state_slot_ids)
            buf.state_slots[n:].fill_(-1)
        self.num_rows.fill_(n)
        return self.replay(n, meta.max_seq_len)

    def replay(self, n: int, max_seq_len: int) -> torch.Tensor:
        """The step graph on the buffers as they are (filled by run(), or moved on by a sampling graph or advance()):
        the logits of the batch's n rows, whose longest context is max_seq_len."""
        self._replay_step(self.graphs[self._key(n, max_seq_len)])
        return self.logits[:n]

    def _replay_step(self, graph: torch.cuda.CUDAGraph):
        """Replays a graph that runs a decode step, counted as ring_state[0] counts it on the device."""
        graph.replay()
        self.replays += 1

    def ring_tokens(self, n: int) -> torch.Tensor:
        """Where the host finds the n tokens of the last step replayed, once its sampling (graph or advance()) has
        run on the device: a view of pinned memory, valid for TOKEN_RING_ROWS - 1 more steps."""
        return self.token_ring[(self.replays - 1) % TOKEN_RING_ROWS, :n]

    def sample(self, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """After run(): draw the batch's tokens from its logits and make them its next inputs; [n] int64."""
        n = temperature.shape[0]
        self.temperature[:n].copy_(temperature)
        self.seeds[:n].copy_(seeds)
        self.steps[:n].copy_(steps)
        self.sample_graphs[self._bucket(n)].replay()
        return self.tokens[:n]

    def set_blocks(self, rows: torch.Tensor, columns: torch.Tensor, block_ids: torch.Tensor):
        """Block table entries that the batch's sequences took since the buffers were filled."""
        self.buffers.block_tables[rows, columns] = block_ids.to(torch.int32)

    def advance(self, tokens: torch.Tensor, steps: torch.Tensor):
        """After run() and a sampler outside the graphs: tokens become the next inputs, steps + 1 (in place)."""
        advance_decode_inputs(tokens, self.buffers.input_ids[:tokens.shape[0]],
                              self.buffers.positions[:tokens.shape[0]], steps, self.num_rows, self.token_ring,
                              self.ring_state)

    def run_steady(self, n: int, max_seq_len: int) -> torch.Tensor:
        """The next step of the batch that the last sample() left in the buffers (its longest context max_seq_len):
        its tokens."""
        key = self._key(n, max_seq_len)
        if key in self.steady_graphs:
            self._replay_step(self.steady_graphs[key])
        else:
            self.replay(n, max_seq_len)
            self.sample_graphs[key[0]].replay()
        return self.tokens[:n]


class PrefillCUDAGraphRunner:
    """Steps with prefills (chunks of prompts beside decodes) of up to max_tokens tokens and max_seqs
    sequences: run() returns the hidden states of the real tokens. The attention grid is a flat tile list
    (kernels.paged_attention.prefill_tiles) with room for any batch of the bucket, so no host value of the step
    is baked into the graph."""

    def __init__(self, model, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 block_size: int, scratch_block: int, hidden_size: int, gqa_group: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.max_model_len = max_model_len
        self.max_seqs = max_seqs
        self.tile_tokens = prefill_tile_tokens(gqa_group)
        self.token_counts = prefill_graph_sizes(max_tokens)
        self.buffers = _StepBuffers(max_tokens, max_seqs, max_blocks_per_seq, scratch_block, block_size, device)
        # + 16: a step's tile list arrives padded to a multiple of 16 entries (prepare_inputs' alignment)
        self.tiles = torch.full((2, self._num_tiles(max_tokens) + 16), -1, dtype=torch.int32, device=device)
        self.hidden = torch.empty(max_tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _num_tiles(self, tokens: int) -> int:
        return max_prefill_tiles(tokens, self.max_seqs, self.tile_tokens)

    def _meta(self, tokens: int) -> AttentionMetadata:
        buf, s = self.buffers, self.max_seqs
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:tokens], query_start_loc=buf.query_start_loc[:s + 1],
            seq_lens=buf.seq_lens[:s], block_tables=buf.block_tables[:s], num_decodes=0,
            max_query_len=tokens, max_seq_len=self.max_model_len, query_start_loc_cpu=None, seq_lens_cpu=None,
            prefill_tiles=self.tiles[:, :self._num_tiles(tokens)])

    def _step(self, tokens: int):
        self.hidden[:tokens] = self.model(self.buffers.input_ids[:tokens], self.buffers.positions[:tokens],
                                          self._meta(tokens))

    @torch.inference_mode()
    def capture(self, pool=None):
        return _capture(self.graphs, self.token_counts, self._step, pool)

    def graph_dicts(self) -> list[dict]:
        return [self.graphs]

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return (meta.prefill_tiles is not None and num_tokens <= self.token_counts[-1]
                and meta.num_seqs <= self.max_seqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, b = input_ids.shape[0], meta.num_seqs
        tokens = next(t for t in self.token_counts if t >= n)
        buf = self.buffers
        buf.fill_tokens(input_ids, positions, meta.slot_mapping, tokens)
        buf.fill_seqs(meta)
        buf.query_start_loc[:b + 1].copy_(meta.query_start_loc)
        used = meta.prefill_tiles.shape[1]
        self.tiles[:, :used].copy_(meta.prefill_tiles)
        self.tiles[:, used:self._num_tiles(tokens)].fill_(-1)
        self.graphs[tokens].replay()
        return self.hidden[:n]


def capture_graphs(model, config, plan, backend, gqa_group: int) -> tuple[CUDAGraphRunner, PrefillCUDAGraphRunner | None]:
    """The decode graphs, and where the plan says so the prefill graphs, sharing one memory pool."""
    mc, block_size, num_blocks = config.model_config, plan.kv.block_size, plan.kv.num_gpu_blocks
    blocks_per_seq = round_up(-(-mc.max_model_len // block_size), ALIGN)
    decode = CUDAGraphRunner(model, min(config.max_num_seqs, 512), blocks_per_seq,
                             lambda bs: backend.decode_context_bounds(bs, mc.max_model_len), block_size, num_blocks,
                             mc.vocab_size, plan.dtype, plan.device)
    pool = decode.capture()
    logger.debug(f"captured CUDA graphs for decode batch sizes {decode.batch_sizes[0]}..{decode.batch_sizes[-1]} "
                 f"(with the LM head), at context bounds {decode.context_bounds[1]} for one sequence")
    if not plan.prefill_graphs:
        return decode, None
    prefill = PrefillCUDAGraphRunner(model, config.max_num_batched_tokens, config.max_num_seqs, blocks_per_seq,
                                     mc.max_model_len, block_size, num_blocks, mc.hf_config.hidden_size, gqa_group,
                                     plan.dtype, plan.device)
    prefill.capture(pool)
    logger.debug(f"captured CUDA graphs for steps with prefills of {prefill.token_counts[0]}.."
                 f"{prefill.token_counts[-1]} tokens")
    return decode, prefill
