from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import get_attention_backend
from nanovllm.config import Config
from nanovllm.device_arrays import to_device
from nanovllm.distributed.parallel_state import all_reduce, tp_rank, tp_size
from nanovllm.engine.cpu_allocator import keep_freed_memory
from nanovllm.engine.input_batch import SteadyDecode, prepare_inputs
from nanovllm.engine.model_loader import apply_kernels, load_model
from nanovllm.engine.plan import ExecutionPlan
from nanovllm.engine.sequence import Sequence
from nanovllm.kvcache import kv_cache
from nanovllm.kvcache.block_copy import BlockCopy, run_block_copies
from nanovllm.kvcache.preemption import PreemptionPolicy, measured_policy
from nanovllm.kvcache.spec import KVCacheSpec, model_kv_cache_spec
from nanovllm.layers.attention import Attention
from nanovllm.layers.logprobs import PROMPT_LOGPROBS_CHUNK, TokenLogprobs, gather_logprobs, prompt_logprobs
from nanovllm.layers.sampler import Sampler, prepare_sampling
from nanovllm.logger import logger
from nanovllm.sampling_params import SamplingParams


@dataclass
class StepHandle:
    """A step launched on the device whose sampled tokens may still be in flight."""

    seqs: list[Sequence]
    prompt_logprobs: list[list[TokenLogprobs]]
    sample_idx: list[int]  # rows of seqs that sample a token this step
    tokens: torch.Tensor | None = None  # [len(sample_idx)] on the device
    tokens_host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    raw_logprobs: torch.Tensor | None = None
    max_logprobs: int = -1


@dataclass
class RunnerOutput:
    sampled: list[int | None]  # per scheduled seq: the new token, None while its prompt is still filling
    logprobs: list[TokenLogprobs | None]  # per scheduled seq, when it asked for logprobs
    prompt_logprobs: list[list[TokenLogprobs]]  # per scheduled seq: entries for this step's prompt positions


class ModelRunner:
    """Turns scheduled sequences into new tokens: builds the model, its KV cache and its graphs as the execution plan
    says (engine/plan.py), then launches each step and collects its tokens."""

    def __init__(self, config: Config, stop_token_ids: set[int]):
        self.config, mc = config, config.model_config
        self.hf_config, self.vocab_size = mc.hf_config, mc.vocab_size
        self.device = torch.device(config.device)
        self.stop_token_ids = sorted(stop_token_ids)
        self.model, self.streamer = load_model(config, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.gqa_group = self.attention_layers[0].num_heads // self.attention_layers[0].num_kv_heads
        self.backend = get_attention_backend(config.attention_backend, config.device, mc.max_model_len,
                                             config.block_size, mc.dtype)
        for layer in self.attention_layers:
            layer.backend = self.backend
        plan = ExecutionPlan.decide(config, self.model, self.backend, self.streamer)
        apply_kernels(self.model, plan, self.streamer)
        self.kv_spec = model_kv_cache_spec(self.model, config.block_size, mc.dtype)  # what each layer keeps
        self.plan = plan.with_kv(self._size_kv_cache(plan, self.kv_spec))
        self.kv_cache = kv_cache.allocate_kv_cache(self.model, self.kv_spec, self.plan.kv, config.max_num_seqs,
                                                   self.device)
        tier = kv_cache.make_host_tier(config, self.model, self.attention_layers, self.kv_cache, self.plan.kv,
                                       plan.fast_kernels, self.streamer is not None) \
            if config.kv_offloading_size is not None else None
        self.host_pool, self.layer_major = (tier.pool, tier.layer_major) if tier else (None, None)
        self.preemption = self._preemption_policy()
        if self.device.type == "cpu":
            keep_freed_memory()  # after loading: load-time temporaries are returned to the OS as before
        self.sampler = Sampler(use_triton=plan.fast_kernels)
        self.graphs = self.prefill_graphs = self.logit_row_buckets = None
        if self.device.type == "cuda":
            from nanovllm.engine.cuda_graph import capture_graphs, graph_batch_sizes  # CUDA only: Triton kernels

            if self.plan.cuda_graphs:
                self.graphs, self.prefill_graphs = capture_graphs(self.model, config, self.plan, self.backend,
                                                                  self.gqa_group)
            self.logit_row_buckets = graph_batch_sizes(config.max_num_seqs)  # the LM head's row counts, warmed up
        self._warm_up_sampling()
        if tp_rank() == 0:
            logger.info(self.plan.table(mc.max_model_len))
        self.steady: SteadyDecode | None = None
        self.num_steady_steps = 0  # statistics: decode steps launched with no inputs from the host
        self.wait_for = torch.cuda.Event.synchronize  # how the host waits for a step (tensor parallel: watching its workers)

    def captured_graphs(self) -> list[dict]:
        """The dicts of every captured CUDA graph (tensor parallelism frees them before its communicator, which
        waits for the graphs that captured its collectives)."""
        return [d for runner in (self.graphs, self.prefill_graphs) if runner is not None for d in runner.graph_dicts()]

    def _size_kv_cache(self, plan: ExecutionPlan, spec: KVCacheSpec) -> kv_cache.KVCacheLayout:
        cfg, mc = self.config, self.config.model_config
        reserved = 0 if cfg.kv_offloading_size is None else \
            kv_cache.offload_reserve_bytes(spec, mc.max_model_len, mc.hf_config.hidden_size * mc.dtype.itemsize)
        rows = max(cfg.max_num_seqs, PROMPT_LOGPROBS_CHUNK)
        num_blocks = kv_cache.num_device_blocks(
            cfg, spec, self.device, lambda: kv_cache.activation_peak(self.model, cfg, self.device, rows,
                                                                     plan.prefill_graphs), reserved)
        if tp_size() > 1:  # every rank holds the same blocks (of its heads): as many as the fullest GPU allows
            num_blocks = int(all_reduce(torch.tensor([num_blocks], device=self.device), "min").item())
        num_host = kv_cache.num_host_blocks(cfg.kv_offloading_size, spec)
        kv_cache.check_capacity(num_blocks, num_host, cfg.block_size, mc.max_model_len)
        return kv_cache.KVCacheLayout(num_blocks, num_host, cfg.block_size, spec.block_bytes)

    def _preemption_policy(self) -> PreemptionPolicy:
        """preemption_mode as set, or (None, with a host pool) the swap-or-recompute costs measured now."""
        mode = self.config.preemption_mode
        if self.host_pool is None or mode is not None:
            return PreemptionPolicy(mode or "recompute")
        c, attn = self.hf_config, self.attention_layers[0]
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        layer_params = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
        return measured_policy(self.kv_cache, self.host_pool.pool, 2 * c.num_hidden_layers * layer_params)

    @torch.inference_mode()
    def _warm_up_sampling(self):
        """Compile the sampling kernels, and let cuBLAS pick the LM head's kernel at every row bucket, now rather
        than inside timed steps (a new row count stalled the host ~5 ms on the H100)."""
        for rows in self.logit_row_buckets or []:
            self.model.compute_logits(torch.zeros(rows, self.hf_config.hidden_size, dtype=self.plan.dtype,
                                                  device=self.device))
        if not self.plan.fast_kernels:
            return
        for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
            seq = Sequence("warm-up", 0, [0], params, seed=0, arrival=0)
            self.sampler(torch.zeros(1, self.vocab_size, dtype=self.plan.dtype, device=self.device),
                         self.prepare_sampling([seq]))

    def prepare_sampling(self, seqs: list[Sequence]):
        return prepare_sampling(seqs, self.vocab_size, self.stop_token_ids, self.device)

    def _to_device(self, array, dtype: torch.dtype) -> torch.Tensor:
        return to_device(array, dtype, self.device)

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], block_copies: list[BlockCopy] = (),
               input_ids_from: tuple[torch.Tensor, list[int], list[int]] | None = None) -> StepHandle:
        """Start one step on the device, after its block copies, and return without waiting for its tokens.
        `input_ids_from` (tokens, src, dst): input ids dst are rows src of a previous step's sampled tokens, still on
        the device (a pipelined step; the host holds placeholders for them)."""
        if block_copies:
            self.copy_blocks(block_copies)
        if self.steady is not None and self.steady.continues(seqs):
            return self._launch_steady()
        self.steady = None
        input_ids, positions, meta = prepare_inputs(seqs, self.plan.kv.block_size, self.gqa_group, self.device)
        if input_ids_from is not None:
            tokens, src, dst = input_ids_from
            if src == dst == list(range(input_ids.shape[0])) and len(src) == tokens.shape[0]:
                input_ids.copy_(tokens)  # a steady decode batch: every row, in the same order
            elif src:
                rows = self._to_device(np.array([src, dst], dtype=np.int64), torch.int64)
                input_ids.index_copy_(0, rows[1], tokens[rows[0]])
        hidden, all_logits = self._forward(seqs, input_ids, positions, meta)
        handle = StepHandle(seqs, prompt_logprobs(seqs, hidden, meta.query_start_loc_cpu, self.model.compute_logits,
                                                  self._to_device),
                            [i for i, s in enumerate(seqs) if s.is_prefill_done])
        if handle.sample_idx:
            self._sample(handle, hidden, all_logits, meta)
        return handle

    def copy_blocks(self, block_copies: list[BlockCopy]):
        run_block_copies(block_copies, self.kv_cache, self.host_pool.pool)

    def _forward(self, seqs, input_ids, positions, meta) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden states, or a decode graph's logits of every row): a layer-major prefill, an eager step over host
        blocks, a graph replay, or an eager step."""
        if self.layer_major is not None and self.layer_major.takes(seqs):  # kvcache/layer_major.py
            seq = seqs[0]
            return self.layer_major.run(input_ids, positions, seq.num_computed_tokens, seq.host_blocks,
                                        seq.block_table[len(seq.host_blocks):]), None
        if meta.offloaded is None and self.graphs is not None and meta.num_decodes == len(seqs) \
                and self.graphs.can_run(len(seqs)):
            return None, self.graphs.run(input_ids, positions, meta)
        if meta.offloaded is None and self.prefill_graphs is not None \
                and self.prefill_graphs.can_run(meta, input_ids.shape[0]):
            return self.prefill_graphs.run(input_ids, positions, meta), None
        return self.model(input_ids, positions, meta), None  # (attention over host blocks runs eagerly)

    def _sample(self, handle: StepHandle, hidden, all_logits, meta):
        seqs = handle.seqs
        tensors = self.prepare_sampling([seqs[i] for i in handle.sample_idx])
        every_row = len(handle.sample_idx) == len(seqs)
        steady = all_logits is not None and every_row and tensors.steady
        if steady and tensors.temperature_only:
            # the decode graph's own sampling: it also leaves the next step's inputs on the device
            handle.tokens = self.graphs.sample(tensors.temperature, tensors.seeds, tensors.steps)
        else:
            if all_logits is not None:  # a decode graph: one row per sequence
                logits = all_logits if every_row else all_logits[self._to_device(handle.sample_idx, torch.int64)]
            else:
                logits = self._compute_logits(hidden, [meta.query_start_loc_cpu[i + 1] - 1 for i in handle.sample_idx])
            handle.tokens, handle.raw_logprobs = self.sampler(logits, tensors)
            if steady:
                self.graphs.advance(handle.tokens, tensors.steps)
        if steady:
            self.steady = SteadyDecode(seqs, [len(s.block_table) for s in seqs], meta.max_seq_len,
                                       None if tensors.temperature_only else tensors)
        handle.max_logprobs = tensors.max_logprobs
        self._read_back(handle, from_ring=steady)

    def _launch_steady(self) -> StepHandle:
        """The steady batch's next decode step: its new KV blocks, then the decode graph and its sampling (the
        sampling graph, or the eager sampler and the advance kernel)."""
        steady = self.steady
        seqs = steady.seqs
        entries = steady.new_blocks()
        if entries:
            rows, columns, block_ids = self._to_device(np.array(entries, dtype=np.int64).T.copy(), torch.int64)
            self.graphs.set_blocks(rows, columns, block_ids)
        steady.max_seq_len += 1
        self.num_steady_steps += 1
        handle = StepHandle(seqs, [[] for _ in seqs], list(range(len(seqs))))
        if steady.sampling is None:
            handle.tokens = self.graphs.run_steady(len(seqs), steady.max_seq_len)
        else:
            handle.tokens, _ = self.sampler(self.graphs.replay(len(seqs), steady.max_seq_len), steady.sampling)
            self.graphs.advance(handle.tokens, steady.sampling.steps)
        self._read_back(handle, from_ring=True)
        return handle

    def _read_back(self, handle: StepHandle, from_ring: bool = False):
        """Start copying the handle's tokens to the host; from_ring: the decode graphs' advance kernel writes them
        to the host itself (CUDAGraphRunner.ring_tokens)."""
        if self.device.type != "cuda":
            handle.tokens_host = handle.tokens
            return
        if from_ring:
            handle.tokens_host = self.graphs.ring_tokens(handle.tokens.shape[0])
        else:  # the copy lands while the host prepares the next step
            handle.tokens_host = torch.empty(handle.tokens.shape, dtype=handle.tokens.dtype, pin_memory=True)
            handle.tokens_host.copy_(handle.tokens, non_blocking=True)
        handle.ready = torch.cuda.Event()
        handle.ready.record()

    def _compute_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of hidden's `rows`; on CUDA the LM head runs on a warmed-up bucket of rows (repeats of the
        last), so that cuBLAS never meets a new shape mid-run."""
        n = len(rows)
        padded = rows
        if self.logit_row_buckets is not None:
            padded = rows + rows[-1:] * (next(b for b in self.logit_row_buckets if b >= n) - n)
        every_row = n == hidden.shape[0] and len(padded) == n  # rows are increasing: then they are all of hidden
        picked = hidden if every_row else hidden[self._to_device(padded, torch.int64)]
        return self.model.compute_logits(picked)[:n]

    @torch.inference_mode()
    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step's tokens."""
        seqs = handle.seqs
        sampled: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if handle.sample_idx:
            if handle.ready is not None:
                self.wait_for(handle.ready)
            token_list = handle.tokens_host.tolist()
            lp = (gather_logprobs(handle.raw_logprobs, handle.tokens, handle.max_logprobs)
                  if handle.raw_logprobs is not None else None)
            for j, i in enumerate(handle.sample_idx):
                sampled[i] = token_list[j]
                if lp is not None and seqs[i].params.logprobs is not None:
                    logprobs[i] = lp[j]
        return RunnerOutput(sampled, logprobs, handle.prompt_logprobs)
