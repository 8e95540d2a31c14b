"""A long prompt prefilled straight into the host pool, one layer at a time.

Chunked prefill over an offloaded prefix (offload_engine.py) streams the whole prefix through the ring once a
chunk: a prompt of T tokens in chunks of C moves ~T^2 / 2C tokens of KV over the link (~27 GB for 32K tokens of
Qwen3-0.6B in chunks of 2K: 0.5 s at 55 GB/s, as long as its whole resident prefill). Here the prompt runs a layer at
a time instead. The layer's KV of the whole context sits in a staging buffer on the GPU (what the pool already holds
of it loaded once), every chunk of the prompt attends causally to it, and the new KV leaves once: to its pool blocks
and to the device blocks of the tail that stays on the GPU. Two staging buffers alternate by layer, so a layer's
copies run on a transfer stream while the next layer computes. A prompt takes this path in a step of its own
(engine/scheduler.py); its hidden states for every token stay on the GPU between layers."""
import contextlib

import torch

from nanovllm.attention.merge import attention_with_lse
from nanovllm.attention.metadata import AttentionMetadata, prefill_tile_tokens, prefill_tiles
from nanovllm.comm.sgdma import copy_blocks


class LayerMajorPrefill:

    def __init__(self, model, kv_cache: torch.Tensor, pool: torch.Tensor, max_tokens: int, chunk_tokens: int,
                 fast: bool):
        """kv_cache / pool: the device cache and the host pool, [2, layers, blocks, block_size, kv_heads, head_dim];
        max_tokens: the longest context (max_model_len); chunk_tokens: a chunk's tokens (max_num_batched_tokens, what
        the activations were sized for); fast: the Triton paged prefill (else plain torch, the twin)."""
        self.model, self.kv_cache, self.pool, self.chunk_tokens, self.fast = model, kv_cache, pool, chunk_tokens, fast
        self.block_size = pool.shape[3]
        max_blocks = -(-max_tokens // self.block_size)
        self.staging = [torch.empty((2, 1, max_blocks, *pool.shape[3:]), dtype=pool.dtype, device=kv_cache.device)
                        for _ in range(2)]
        self.tables = torch.arange(max_blocks, dtype=torch.int32, device=kv_cache.device)[None, :]
        self.runs = 0  # statistics: prompts prefilled this way
        self.stream = self.loaded = self.computed = None
        if kv_cache.is_cuda:
            self.stream = torch.cuda.Stream(kv_cache.device)
            self.loaded = [torch.cuda.Event() for _ in range(2)]
            self.computed = [torch.cuda.Event() for _ in range(2)]

    @staticmethod
    def bytes_needed(max_tokens: int, kv_bytes_per_token_and_layer: int, hidden_bytes_per_token: int) -> int:
        """GPU memory of its two staging buffers and of the whole prompt's hidden states, residuals and final norm."""
        return max_tokens * (2 * kv_bytes_per_token_and_layer + 3 * hidden_bytes_per_token)

    def takes(self, seqs) -> bool:
        """Whether this step is such a prefill: one sequence whose new KV has pool blocks waiting for it."""
        return len(seqs) == 1 and len(seqs[0].host_blocks) * self.block_size > seqs[0].num_computed_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, computed: int, host_blocks: list[int],
            device_blocks: list[int]) -> torch.Tensor:
        """The final hidden states of input_ids (positions computed..), whose first `computed` tokens' KV is in pool
        blocks host_blocks[:computed / block_size]; the new KV goes to the rest of host_blocks, then device_blocks."""
        self.runs += 1
        inner = self.model.model
        first = computed // self.block_size
        prefix, stores = host_blocks[:first], (host_blocks[first:], device_blocks)
        metas = self._chunk_metas(computed, input_ids.shape[0], host_blocks, input_ids.device)
        hidden, residual = inner.embed_tokens(input_ids), None
        num_layers = len(inner.layers)
        if self.stream is not None:  # the prefix's copies into the pool, queued by the scheduler, come first
            self.stream.wait_stream(torch.cuda.current_stream())
        for layer in range(min(2, num_layers)):
            self._load(layer, prefix)
        for layer, decoder_layer in enumerate(inner.layers):
            if self.stream is not None:
                torch.cuda.current_stream().wait_event(self.loaded[layer % 2])
            if residual is None:  # the first layer returns its input as the residual: keep it apart from hidden
                residual = torch.empty_like(hidden)
            for (start, end), meta in metas:
                h, r = decoder_layer(positions[start:end], hidden[start:end], residual[start:end] if layer else None,
                                     meta)
                residual[start:end] = r
                hidden[start:end] = h
            self._store(layer, first, *stores)
            if layer + 2 < num_layers:
                self._load(layer + 2, prefix)
        if self.stream is not None:
            self.stream.synchronize()  # the pool's KV complete before any later step's ring reads it
        return inner.norm(hidden, residual)[0]

    def _chunk_metas(self, computed: int, num_tokens: int, host_blocks: list[int], device) -> list:
        """((start, end), meta) of each chunk of the prompt: one sequence whose context ends with the chunk."""
        metas = []
        for start in range(0, num_tokens, self.chunk_tokens):
            end = min(num_tokens, start + self.chunk_tokens)
            rows, context = end - start, computed + end
            # two tensors, not views of one: the Triton kernel specializes on its pointers' alignment
            query_start, lens = (torch.tensor(x, dtype=torch.int32).to(device) for x in ([0, rows], [context]))
            metas.append(((start, end), AttentionMetadata(
                slot_mapping=torch.empty(0, dtype=torch.int64, device=device), query_start_loc=query_start,
                seq_lens=lens, block_tables=self.tables, num_decodes=0, max_query_len=rows,
                max_seq_len=context, query_start_loc_cpu=[0, rows], seq_lens_cpu=[context], offloaded=[host_blocks],
                scratch={"layer_major": self})))
        return metas

    def _load(self, layer: int, prefix: list[int]):
        """The layer's context already in the pool into its staging buffer (queued after that buffer's last
        stores)."""
        with self._transfers():
            copy_blocks(self.pool[:, layer:layer + 1], self.staging[layer % 2], prefix, list(range(len(prefix))))
            if self.stream is not None:
                self.loaded[layer % 2].record(self.stream)

    def _store(self, layer: int, first: int, pool_blocks: list[int], device_blocks: list[int]):
        """The layer's new KV (staging blocks first..) to its pool blocks, then to the device blocks of the tail."""
        buffer = self.staging[layer % 2]
        split = first + len(pool_blocks)
        to_pool, to_device = list(range(first, split)), list(range(split, split + len(device_blocks)))
        if self.stream is not None:
            self.computed[layer % 2].record()
            self.stream.wait_event(self.computed[layer % 2])
        with self._transfers():
            copy_blocks(buffer, self.pool[:, layer:layer + 1], to_pool, pool_blocks)
            copy_blocks(buffer, self.kv_cache[:, layer:layer + 1], to_device, device_blocks)

    def _transfers(self):
        """Where the staging buffers' copies are queued: the transfer stream on CUDA (in order on CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """A chunk's attention: its K/V into the layer's staging buffer at their positions, then its queries against
        the whole context so far, causal."""
        buffer = self.staging[layer % 2]
        end = meta.seq_lens_cpu[0]
        start = end - q.shape[0]
        keys, values = buffer[0, 0].flatten(0, 1), buffer[1, 0].flatten(0, 1)  # [tokens, kv_heads, head_dim]
        keys[start:end], values[start:end] = k, v
        if self.fast:
            from nanovllm.kernels.paged_attention import paged_prefill

            if "tiles" not in meta.scratch:
                tiles = prefill_tiles([q.shape[0]], prefill_tile_tokens(q.shape[1] // k.shape[1]))
                meta.scratch["tiles"] = torch.from_numpy(tiles).to(q.device)
            return paged_prefill(q, buffer[0, 0], buffer[1, 0], self.tables, meta.seq_lens, meta.query_start_loc,
                                 meta.scratch["tiles"], scale)
        query_pos = torch.arange(start, end, device=q.device)
        key_pos = torch.arange(end, device=q.device)
        out, _ = attention_with_lse(q, keys[:end], values[:end], scale, key_pos[None, :] <= query_pos[:, None])
        return out.to(q.dtype)
