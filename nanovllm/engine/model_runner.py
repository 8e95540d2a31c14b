import numpy as np
import torch

from nanovllm.attention import get_attention_backend
from nanovllm.config import Config
from nanovllm.device_arrays import to_device
from nanovllm.distributed.parallel_state import all_reduce, broadcast, tp_rank, tp_size
from nanovllm.engine.cpu_allocator import keep_freed_memory
from nanovllm.engine.input_batch import SteadyDecode, prepare_inputs
from nanovllm.engine.model_loader import apply_kernels, load_model
from nanovllm.engine.plan import ExecutionPlan
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_command import (
    DECODE_GRAPH,
    EAGER,
    LAYER_MAJOR,
    PREFILL_GRAPH,
    STEADY,
    RunnerOutput,
    StepCommand,
    StepHandle,
)
from nanovllm.kvcache import kv_cache
from nanovllm.kvcache.block_copy import BlockCopy, run_block_copies
from nanovllm.kvcache.preemption import preemption_policy
from nanovllm.kvcache.spec import KVCacheSpec, model_kv_cache_spec
from nanovllm.layers.attention import Attention
from nanovllm.layers.logprobs import PROMPT_LOGPROBS_CHUNK, PromptScoring, TokenLogprobs, gather_logprobs
from nanovllm.layers.sampler import Sampler, SamplingTensors, prepare_sampling
from nanovllm.logger import logger
from nanovllm.sampling_params import SamplingParams


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
                                       plan.fast_kernels, self.streamer is None and not self.kv_spec.states) \
            if config.kv_offloading_size is not None else None
        self.host_pool, self.layer_major = (tier.pool, tier.layer_major) if tier else (None, None)
        # a state slot is given back on preemption: such a sequence computes again from its first token
        mode = "recompute" if self.kv_spec.states else config.preemption_mode
        self.preemption = preemption_policy(mode, self.kv_cache, tier and tier.pool.pool,
                                            self.hf_config, self.attention_layers[0])
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
        self.followers = None  # tensor parallelism's other ranks (distributed/workers.py): each step is sent to them

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
        return kv_cache.KVCacheLayout(num_blocks, num_host, cfg.block_size, spec.block_bytes,
                                      cfg.max_num_seqs if spec.states else 0, spec.slot_bytes)

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
        if self.steady is not None and self.steady.continues(seqs):
            return self._launch_steady(list(block_copies))
        self.steady = None
        input_ids, positions, meta = prepare_inputs(seqs, self.plan.kv.block_size, self.gqa_group, self.device)
        if input_ids_from is not None:
            tokens, src, dst = input_ids_from
            if src == dst == list(range(input_ids.shape[0])) and len(src) == tokens.shape[0]:
                input_ids.copy_(tokens)  # a steady decode batch: every row, in the same order
            elif src:
                rows = self._to_device(np.array([src, dst], dtype=np.int64), torch.int64)
                input_ids.index_copy_(0, rows[1], tokens[rows[0]])
        scoring = PromptScoring(seqs, meta.query_start_loc_cpu)
        command = StepCommand(self._path(seqs, input_ids, meta), list(block_copies), input_ids, positions, meta,
                              prompt_rows=[self._to_device(rows, torch.int64) for rows in scoring.row_chunks])
        if command.path == LAYER_MAJOR:
            seq = seqs[0]
            command.layer_major = (seq.num_computed_tokens, seq.host_blocks, seq.block_table[len(seq.host_blocks):])
        handle = StepHandle(seqs, scoring.out, [i for i, s in enumerate(seqs) if s.is_prefill_done])
        sampling = self._plan_sampling(command, handle) if handle.sample_idx else None
        handle.tokens = self._execute_led(command, sampling and self._sampler_for(handle, sampling), scoring.add)
        if handle.sample_idx:
            handle.max_logprobs = sampling.max_logprobs
            self._read_back(handle, from_ring=self.steady is not None)
        return handle

    def _path(self, seqs: list[Sequence], input_ids: torch.Tensor, meta) -> str:
        """A layer-major prefill, a decode graph replay, a prefill graph replay, or an eager step (attention over
        host blocks runs eagerly)."""
        if self.layer_major is not None and self.layer_major.takes(seqs):  # kvcache/layer_major.py
            return LAYER_MAJOR
        if meta.offloaded is None and self.graphs is not None and meta.num_decodes == len(seqs) \
                and self.graphs.can_run(len(seqs)):
            return DECODE_GRAPH
        if meta.offloaded is None and self.prefill_graphs is not None \
                and self.prefill_graphs.can_run(meta, input_ids.shape[0]):
            return PREFILL_GRAPH
        return EAGER

    def _plan_sampling(self, command: StepCommand, handle: StepHandle) -> SamplingTensors:
        """Which rows sample and how: the decode graph's sampling graph, or rank 0's sampler on their logits (then,
        for a batch that decodes again, the tokens become the graph's next inputs on the device)."""
        seqs, idx = handle.seqs, handle.sample_idx
        tensors = self.prepare_sampling([seqs[i] for i in idx])
        every_row = len(idx) == len(seqs)
        steady = command.path == DECODE_GRAPH and every_row and tensors.steady
        command.num_samples = len(idx)
        if steady and tensors.temperature_only:
            command.graph_sampling = (tensors.temperature, tensors.seeds, tensors.steps)
        elif command.path == DECODE_GRAPH:
            command.sample_rows = None if every_row else self._to_device(idx, torch.int64)
        else:
            command.sample_rows = self._logit_rows([command.meta.query_start_loc_cpu[i + 1] - 1 for i in idx],
                                                   command.input_ids.shape[0])
        if steady:
            command.advance_steps = None if tensors.temperature_only else tensors.steps
            self.steady = SteadyDecode(seqs, [len(s.block_table) for s in seqs], command.meta.max_seq_len,
                                       None if tensors.temperature_only else tensors)
        return tensors

    def _logit_rows(self, rows: list[int], num_rows: int) -> torch.Tensor | None:
        """The rows of hidden whose logits are sampled (None: all of them); on CUDA padded to a warmed-up bucket
        (repeats of the last), so that cuBLAS never meets a new LM head shape mid-run."""
        n = len(rows)
        if self.logit_row_buckets is not None:
            rows = rows + rows[-1:] * (next(b for b in self.logit_row_buckets if b >= n) - n)
        every_row = n == num_rows and len(rows) == n  # rows are increasing: then they are all of hidden
        return None if every_row else self._to_device(rows, torch.int64)

    def _sampler_for(self, handle: StepHandle, tensors: SamplingTensors):
        def sample(logits: torch.Tensor) -> torch.Tensor:
            tokens, handle.raw_logprobs = self.sampler(logits, tensors)
            return tokens
        return sample

    def _launch_steady(self, block_copies: list[BlockCopy]) -> StepHandle:
        """The steady batch's next decode step: its new KV blocks, then the decode graph and its sampling (the
        sampling graph, or the eager sampler and the advance kernel)."""
        steady = self.steady
        seqs = steady.seqs
        steady.max_seq_len += 1
        self.num_steady_steps += 1
        command = StepCommand(STEADY, block_copies, steady=(len(seqs), steady.max_seq_len), num_samples=len(seqs))
        if entries := steady.new_blocks():
            command.new_blocks = tuple(self._to_device(np.array(entries, dtype=np.int64).T.copy(), torch.int64))
        if steady.sampling is not None:
            command.advance_steps = steady.sampling.steps
        handle = StepHandle(seqs, [[] for _ in seqs], list(range(len(seqs))))
        sample = None if steady.sampling is None else lambda logits: self.sampler(logits, steady.sampling)[0]
        handle.tokens = self._execute_led(command, sample)
        self._read_back(handle, from_ring=True)
        return handle

    def _execute_led(self, command: StepCommand, sample=None, score=None) -> torch.Tensor | None:
        if self.followers is None:
            return self.execute(command, sample, score)
        return self.followers.lead(command, lambda: self.execute(command, sample, score))

    def execute(self, command: StepCommand, sample=None, score=None) -> torch.Tensor | None:
        """Run a step command; every tensor-parallel rank runs the same one. Rank 0 passes sample (logits -> tokens)
        and score (chunk, logits of command.prompt_rows[chunk]) and gets the sampled tokens on the device."""
        if command.block_copies:
            run_block_copies(command.block_copies, self.kv_cache, self.host_pool.pool)
        if command.path == STEADY:
            return self._execute_steady(command, sample)
        hidden, logits = self._forward(command)
        for chunk, rows in enumerate(command.prompt_rows):
            chunk_logits = self.model.compute_logits(hidden[rows])
            if score is not None:
                score(chunk, chunk_logits)
        if not command.num_samples:
            return None
        if command.graph_sampling is not None:
            return self.graphs.sample(*command.graph_sampling)
        rows = command.sample_rows
        if logits is None:
            logits = self.model.compute_logits(hidden if rows is None else hidden[rows])[:command.num_samples]
        elif rows is not None:
            logits = logits[rows]
        return self._sample_and_advance(command, logits, sample)

    def _forward(self, command: StepCommand) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden states, or a decode graph's logits of every row)."""
        ids, positions, meta = command.input_ids, command.positions, command.meta
        if command.path == LAYER_MAJOR:
            return self.layer_major.run(ids, positions, *command.layer_major), None
        if command.path == DECODE_GRAPH:
            return None, self.graphs.run(ids, positions, meta)
        if command.path == PREFILL_GRAPH:
            return self.prefill_graphs.run(ids, positions, meta), None
        return self.model(ids, positions, meta), None

    def _execute_steady(self, command: StepCommand, sample) -> torch.Tensor:
        n, max_seq_len = command.steady
        if command.new_blocks is not None:
            self.graphs.set_blocks(*command.new_blocks)
        if command.advance_steps is None:
            return self.graphs.run_steady(n, max_seq_len)
        return self._sample_and_advance(command, self.graphs.replay(n, max_seq_len), sample)

    def _sample_and_advance(self, command: StepCommand, logits: torch.Tensor, sample) -> torch.Tensor:
        """Rank 0 samples (the other ranks hold a buffer); a batch that decodes again takes rank 0's tokens as the
        decode graph's next inputs on every rank."""
        tokens = sample(logits) if sample is not None else \
            torch.empty(command.num_samples, dtype=torch.int64, device=self.device)
        if command.advance_steps is not None:
            self.graphs.advance(broadcast(tokens), command.advance_steps)
        return tokens

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

    @torch.inference_mode()
    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a launched step's tokens."""
        seqs = handle.seqs
        sampled: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if handle.sample_idx:
            if handle.ready is not None:
                if self.followers is not None:
                    self.followers.wait_for(handle.ready)  # watching the workers while it waits
                else:
                    handle.ready.synchronize()
            token_list = handle.tokens_host.tolist()
            lp = (gather_logprobs(handle.raw_logprobs, handle.tokens, handle.max_logprobs)
                  if handle.raw_logprobs is not None else None)
            for j, i in enumerate(handle.sample_idx):
                sampled[i] = token_list[j]
                if lp is not None and seqs[i].params.logprobs is not None:
                    logprobs[i] = lp[j]
        return RunnerOutput(sampled, logprobs, handle.prompt_logprobs)
