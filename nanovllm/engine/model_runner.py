import itertools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata, get_attention_backend
from nanovllm.attention.metadata import prefill_tile_tokens, prefill_tiles
from nanovllm.config import Config
from nanovllm.distributed.parallel_state import all_reduce, tp_size
from nanovllm.engine.cpu_allocator import keep_freed_memory
from nanovllm.engine.sequence import Sequence
from nanovllm.host_memory import require_host_memory
from nanovllm.kvcache.host_pool import HostKVPool
from nanovllm.kvcache.layer_major import LayerMajorPrefill
from nanovllm.kvcache.offload_engine import OFFLOAD_SLOT_BYTES, OFFLOAD_SLOTS, OffloadEngine, slot_blocks
from nanovllm.kvcache.preemption import PreemptionPolicy, measured_policy
from nanovllm.layers.attention import Attention
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.embed_head import LMHead
from nanovllm.layers.linear import CpuPackedLinearMethod, LinearBase, UnquantizedLinearMethod
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.logger import log_once, logger
from nanovllm.models import get_model_class
from nanovllm.quant.registry import get_quantization_config
from nanovllm.sampling_params import SamplingParams
from nanovllm.streaming.layer_streamer import LayerStreamer
from nanovllm.streaming.placement import weights_do_not_fit
from nanovllm.weights.model_files import iterate_weights

if TYPE_CHECKING:
    from nanovllm.engine.cuda_graph import CUDAGraphRunner, PrefillCUDAGraphRunner

CPU_KV_CACHE_BYTES = 4 << 30
PROMPT_LOGPROBS_CHUNK = 1024  # rows of [rows, vocab] fp32 logits alive at once while scoring prompts
ALIGN = 16  # int32 elements: 64 bytes


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, and the top-k."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


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
class SteadyDecode:
    """The batch of the last decode step whose graphs left its next inputs on the device: launching the same
    sequences again needs only the KV blocks they took since (each row's block count there is known_blocks)."""

    seqs: list[Sequence]
    known_blocks: list[int]
    context_tokens: int  # the step's context lengths summed (the benchmarks' bytes-read count)
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


@dataclass
class RunnerOutput:
    sampled: list[int | None]  # per scheduled seq: the new token, None while its prompt is still filling
    logprobs: list[TokenLogprobs | None]  # per scheduled seq, when it asked for logprobs
    prompt_logprobs: list[list[TokenLogprobs]]  # per scheduled seq: entries for this step's prompt positions


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights that one step reads: each parameter, buffer and quantized weight once (a tied LM head and
    embedding once), except an input embedding that the LM head does not share: a step reads only its tokens' rows
    of that."""
    embed = model.model.embed_tokens
    head = {id(t) for t in [model.lm_head.weight, *(w for _, w in getattr(model.lm_head, "qweights", []))]}
    # parameters and persistent buffers (an int8 / fp8 weight and its scales), not the rotary tables
    weights = {id(t): t.numel() * t.element_size() for t in model.state_dict(keep_vars=True).values() if not t.is_meta}
    for module in model.modules():
        weights.update((id(w), w.nbytes) for _, w in getattr(module, "qweights", []))
    for table in (embed.weight, embed.qweight):
        if table is not None and id(table) not in head:
            weights.pop(id(table), None)
    return sum(weights.values())


class ModelRunner:
    """Owns the model, the KV cache and the sampler; turns scheduled sequences into new tokens."""

    def __init__(self, config: Config, stop_token_ids: set[int]):
        self.config = config
        mc = config.model_config
        self.hf_config = mc.hf_config
        self.device = torch.device(config.device)
        self.dtype = mc.dtype
        self.block_size = config.block_size
        self.vocab_size = mc.vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.model = self._load_model()
        self.streamer = self._stream_layers()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.gqa_group = self.attention_layers[0].num_heads // self.attention_layers[0].num_kv_heads
        self.backend = get_attention_backend(config.attention_backend, config.device, mc.max_model_len,
                                             config.block_size, mc.dtype)
        # the fused Triton layers, GEMV and sampler go with every GPU backend but the torch reference
        self.fast_kernels = self.device.type == "cuda" and self.backend.name != "torch"
        for layer in self.attention_layers:
            layer.backend = self.backend
        self._choose_linear_method()
        self._choose_layer_kernels()
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.layer_major: LayerMajorPrefill | None = None  # set with the host pool
        self.preemption = PreemptionPolicy("recompute")  # swap or recompute: set with the host pool
        self.host_pool = self._make_host_pool()
        if self.device.type == "cpu":
            keep_freed_memory()  # after loading: load-time temporaries are returned to the OS as before
        self.sampler = Sampler(use_triton=self.fast_kernels)
        self.graphs, self.prefill_graphs = self._capture_cuda_graphs()
        # on CUDA the LM head runs on row counts padded to these buckets, each warmed up below
        self.logit_row_buckets = self._logit_row_buckets()
        self._warm_up_sampling()
        self.weight_bytes = weight_bytes_per_step(self.model)
        self.kv_bytes_per_token = self.kv_bytes_per_block() // self.block_size
        self.bytes_read = 0  # weights + KV context read by every step so far (benchmarks' HBM roofline)
        self.steady: SteadyDecode | None = None
        self.num_steady_steps = 0  # statistics: decode steps launched with no inputs from the host
        self.wait_for = torch.cuda.Event.synchronize  # how the host waits for a step (tensor parallel: watching its workers)

    def captured_graphs(self) -> list[dict]:
        """The dicts of every captured CUDA graph (tensor parallelism frees them before its communicator, which
        waits for the graphs that captured its collectives)."""
        return [d for runner in (self.graphs, self.prefill_graphs) if runner is not None for d in runner.graph_dicts()]

    def _graph_skip_reason(self) -> str | None:
        """Why steps will run eagerly (None: they replay CUDA graphs)."""
        if self.device.type != "cuda":
            return "not on CUDA"
        if self.config.enforce_eager:
            return "enforce_eager=True: every step runs eagerly, without CUDA graphs"
        if self.streamer is not None:
            return "weights stream in (cpu_offload_gb / disk_offload_gb): every step runs eagerly"
        if not self.backend.supports_cuda_graphs:
            return f"the {self.backend.name} attention backend cannot be captured: every step runs eagerly"
        return None

    def _captures_prefill_graphs(self) -> bool:
        return self._graph_skip_reason() is None and self.backend.supports_prefill_graphs

    def _logit_row_buckets(self) -> list[int] | None:
        if self.device.type != "cuda":
            return None
        from nanovllm.engine.cuda_graph import graph_batch_sizes  # CUDA only: it imports the Triton kernels

        return graph_batch_sizes(self.config.max_num_seqs)

    def _capture_cuda_graphs(self) -> tuple["CUDAGraphRunner | None", "PrefillCUDAGraphRunner | None"]:
        skip = self._graph_skip_reason()
        if skip is not None:
            if self.device.type == "cuda":
                log_once(skip)
            return None, None
        from nanovllm.engine.cuda_graph import CUDAGraphRunner, PrefillCUDAGraphRunner

        cfg, mc = self.config, self.config.model_config
        blocks_per_seq = _round_up(-(-mc.max_model_len // self.block_size), ALIGN)
        decode = CUDAGraphRunner(self.model, min(cfg.max_num_seqs, 512), blocks_per_seq,
                                 lambda bs: self.backend.decode_context_bounds(bs, mc.max_model_len), self.block_size,
                                 self.num_blocks, mc.vocab_size, self.dtype, self.device)
        pool = decode.capture()
        logger.info(f"captured CUDA graphs for decode batch sizes {decode.batch_sizes[0]}..{decode.batch_sizes[-1]} "
                    f"(with the LM head), at context bounds {decode.context_bounds[1]} for one sequence")
        if not self._captures_prefill_graphs():
            log_once(f"the {self.backend.name} attention backend runs steps with prefills eagerly (decode steps "
                     "replay CUDA graphs)")
            return decode, None
        prefill = PrefillCUDAGraphRunner(self.model, cfg.max_num_batched_tokens, cfg.max_num_seqs, blocks_per_seq,
                                         mc.max_model_len, self.block_size, self.num_blocks, mc.hf_config.hidden_size,
                                         self.gqa_group, self.dtype, self.device)
        prefill.capture(pool)
        logger.info(f"captured CUDA graphs for steps with prefills of {prefill.token_counts[0]}.."
                    f"{prefill.token_counts[-1]} tokens")
        return decode, prefill

    @torch.inference_mode()
    def _warm_up_sampling(self):
        """Compile the sampling kernels, and let cuBLAS pick the LM head's kernel at every row bucket, now rather
        than inside timed steps (a new row count stalled the host ~5 ms on the H100)."""
        if self.device.type == "cuda":
            for rows in self.logit_row_buckets:
                self.model.compute_logits(torch.zeros(rows, self.hf_config.hidden_size, dtype=self.dtype,
                                                      device=self.device))
        if not self.fast_kernels:
            return
        for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
            seq = Sequence("warm-up", 0, [0], params, seed=0, arrival=0)
            self.sampler(torch.zeros(1, self.vocab_size, dtype=self.dtype, device=self.device),
                         self.prepare_sampling([seq]))

    def _load_model(self):
        mc = self.config.model_config
        quant_config = get_quantization_config(mc.quantization, self.device, self.dtype, use_kernels=self.device.type
                                               == "cuda" and self.config.attention_backend != "torch")
        # with streamed layers the model loads in host memory (quantized layers too), so the device need not hold it
        # whole, even once; what stays resident moves to the device after (_stream_layers)
        build_on = "cpu" if self.config.cpu_offload_gb or self.config.disk_offload_gb else self.device
        if quant_config is not None and build_on == "cpu":
            quant_config.load_device = torch.device("cpu")
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        try:
            model = self._build_model(build_on, quant_config)
            model.load_weights(iterate_weights(mc, self.device))
            if quant_config is not None:
                quant_config.finish_loading(model)
            return model.eval()
        except torch.OutOfMemoryError:  # raised below, once the half-built model is released
            model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        raise weights_do_not_fit(mc, self.device, self.config.tensor_parallel_size, free)

    def _build_model(self, device, quant_config):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(device):
                return get_model_class(self.hf_config)(self.hf_config, quant_config)
        finally:
            torch.set_default_dtype(default_dtype)

    def _stream_layers(self) -> LayerStreamer | None:
        """The streamed decoder layers (cpu_offload_gb / disk_offload_gb); the rest of the model moves to the device
        (None: nothing streams, and the model is there already)."""
        cfg = self.config
        if not (cfg.cpu_offload_gb or cfg.disk_offload_gb):
            return None
        streamer = LayerStreamer.for_layers(list(self.model.model.layers), self.device, cfg.cpu_offload_gb,
                                            cfg.disk_offload_gb, cfg.offload_folder)
        self.model.to(self.device)
        streamed = streamer.module_ids()
        for module in self.model.modules():  # quantized blocks are no module tensors: .to() leaves them
            if id(module) not in streamed and getattr(module, "qweights", None):
                module.qweights = [(offset, weight.to(self.device)) for offset, weight in module.qweights]
        return streamer

    def _choose_linear_method(self):
        """fp32 on CPU runs oneDNN-packed weights when this torch build has them; half precision on CUDA with
        the Triton or flash_attn backend runs the Triton GEMV for small batches; otherwise F.linear."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            if not CpuPackedLinearMethod.available():
                log_once("oneDNN packed linear is not available in this torch build: CPU linears run F.linear")
                return
            log_once("CPU linears: oneDNN packed fp32 weights")
            method = CpuPackedLinearMethod
        elif self.fast_kernels and self.dtype != torch.float32:
            from nanovllm.kernels import gemv_one_row
            from nanovllm.layers.gemv_linear import GEMV_ROWS, TritonGemvLinearMethod

            log_once(f"CUDA linears: Triton GEMV up to {GEMV_ROWS} rows, cuBLAS above")
            gemv_one_row.why_off(self.device)  # builds the one-row kernel now (not in a graph capture), logs the path
            method = TritonGemvLinearMethod
        else:
            if self.device.type == "cuda":
                log_once("CUDA linears: cuBLAS only (the Triton GEMV serves bf16/fp16 beside a fast attention backend)")
            return
        # streamed layers' weights change place each step: F.linear reads them where they are
        streamed = self.streamer.module_ids() if self.streamer is not None else set()
        if streamed:
            log_once(f"the streamed decoder layers' linears run F.linear, not {method.__name__}")
        for module in self.model.modules():
            if isinstance(module, (LinearBase, LMHead)) and type(module.linear_method) is UnquantizedLinearMethod \
                    and id(module) not in streamed:
                module.linear_method = method()
                module.linear_method.process_weights_after_loading(module)

    def _choose_layer_kernels(self):
        """Fused Triton layers go with the Triton and flash_attn backends; the torch backend keeps the whole model on
        the plain torch reference path."""
        use_triton = self.fast_kernels
        for module in self.model.modules():
            if isinstance(module, CustomOp):
                module.use_triton = use_triton
            if use_triton and isinstance(module, RotaryEmbedding):
                module.tables(self.dtype)  # cast now, never inside a CUDA graph capture
        if use_triton:
            from nanovllm.kernels import pdl

            log_once("fused Triton layers: RMSNorm (+ residual add), SiLU-and-mul, rotary (+ q/k RMSNorm), embedding gather")
            off = pdl.why_off(self.device)
            log_once("Triton kernels use programmatic dependent launch" if off is None else
                     f"programmatic dependent launch is off ({off}): kernels launch one after another")

    # ---- KV cache -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        layer = self.attention_layers[0]
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.attention_layers) * self.block_size * layer.num_kv_heads * layer.head_dim * element

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        elif cfg.kv_cache_memory_bytes is not None:
            num_blocks = cfg.kv_cache_memory_bytes // self.kv_bytes_per_block()
        elif self.device.type == "cpu":
            num_blocks = CPU_KV_CACHE_BYTES // self.kv_bytes_per_block()
        else:
            num_blocks = self._profile_gpu_blocks()
        if tp_size() > 1:  # every rank holds the same blocks (of its heads): as many as the fullest GPU allows
            num_blocks = int(all_reduce(torch.tensor([num_blocks], device=self.device), "min").item())
        host_blocks = self._num_host_blocks()
        capacity = (num_blocks + host_blocks) * self.block_size
        max_len = cfg.model_config.max_model_len
        if capacity < max_len or num_blocks < 2:
            where = f" and {host_blocks} in host memory" if host_blocks else ""
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {self.block_size}{where}), fewer than "
                f"max_model_len={max_len} (or fewer than 2 device blocks): raise kv_cache_memory_bytes (CPU) or "
                f"gpu_memory_utilization (GPU) or num_gpu_blocks_override or kv_offloading_size, or lower max_model_len")
        return num_blocks

    def _num_host_blocks(self) -> int:
        gib = self.config.kv_offloading_size
        return 0 if gib is None else int(gib * (1 << 30)) // self.kv_bytes_per_block()

    def _profile_gpu_blocks(self) -> int:
        """Free memory after a forward at the largest batch, times gpu_memory_utilization (as vLLM)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        if self._captures_prefill_graphs():  # the prefill graphs' own pool holds a forward's activations too
            activation_peak *= 2
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        if self.config.kv_offloading_size is not None:  # the ring the offloaded KV streams through, and the
            # staging buffers and hidden states of a prompt prefilled a layer at a time
            max_len, layers = self.config.model_config.max_model_len, len(self.attention_layers)
            budget -= OFFLOAD_SLOTS * OFFLOAD_SLOT_BYTES + LayerMajorPrefill.bytes_needed(
                max_len, self.kv_bytes_per_block() // (self.block_size * layers),
                self.hf_config.hidden_size * self.dtype.itemsize)
        num_blocks = int(budget // self.kv_bytes_per_block())
        if num_blocks < 1:
            gib = 1 << 30
            raise ValueError(
                f"no GPU memory is left for the KV cache: {(total - free) / gib:.1f} GiB in use and "
                f"{activation_peak / gib:.1f} GiB of activations, of {total / gib:.1f} GiB at "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization}: raise gpu_memory_utilization, "
                f"lower max_num_batched_tokens or max_num_seqs, stream weights from host memory (cpu_offload_gb) "
                f"or use a smaller model")
        return num_blocks

    @torch.inference_mode()
    def profile_run(self):
        """A forward over max_num_batched_tokens tokens with no KV cache, then sampling max_num_seqs rows."""
        cfg = self.config
        lens = []
        left = cfg.max_num_batched_tokens
        while left > 0:
            lens.append(min(left, cfg.model_config.max_model_len))
            left -= lens[-1]
        num_tokens = sum(lens)
        starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=self.device),
            num_decodes=0, max_query_len=max(lens), max_seq_len=max(lens),
            query_start_loc_cpu=starts, seq_lens_cpu=lens)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, meta)
        rows = min(max(cfg.max_num_seqs, PROMPT_LOGPROBS_CHUNK), num_tokens)  # sampling, or a prompt-logprobs chunk
        logits = self.model.compute_logits(hidden[:rows])
        logits.float().log_softmax(-1).sort(dim=-1)  # the sampler's largest temporaries
        del hidden, logits

    def _allocate_kv_cache(self):
        """One block more than the block manager hands out: the scratch block that CUDA-graph padding rows use."""
        layer = self.attention_layers[0]
        shape = (2, len(self.attention_layers), self.num_blocks + 1, self.block_size, layer.num_kv_heads,
                 layer.head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        tokens, max_len = self.num_blocks * self.block_size, self.config.model_config.max_model_len
        logger.info(f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens "
                    f"({self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 30):.2f} GiB on {self.device}); "
                    f"maximum concurrency for {max_len:,} tokens a sequence: {tokens / max_len:.2f}x")

    def _make_host_pool(self) -> HostKVPool | None:
        """kv_offloading_size GiB of host blocks (None: none) for swapped, cached and offloaded KV, and the ring of
        slots that attends to offloaded blocks."""
        gib = self.config.kv_offloading_size
        if gib is None:
            return None
        num_blocks = self._num_host_blocks()
        require_host_memory(num_blocks * self.kv_bytes_per_block(), f"kv_offloading_size={gib:g}")
        if num_blocks < 1:
            raise ValueError(f"kv_offloading_size={gib} GiB holds no KV block ({self.kv_bytes_per_block()} bytes "
                             "each): raise it")
        attn = self.attention_layers[0]
        host_pool = HostKVPool(self.kv_cache, num_blocks)
        self.preemption = self._preemption_policy(host_pool)
        engine = OffloadEngine(host_pool.pool, OFFLOAD_SLOTS, slot_blocks(host_pool.pool),
                               self.device, fast=self.fast_kernels)
        engine.warm_up(attn.num_heads)
        for i, attn in enumerate(self.attention_layers):
            attn.layer_index, attn.offload_engine = i, engine
        if self.streamer is None:  # (streamed weights would be fetched again for every chunk of a layer)
            self.layer_major = LayerMajorPrefill(self.model, self.kv_cache, host_pool.pool,
                                                 self.config.model_config.max_model_len,
                                                 self.config.max_num_batched_tokens, self.fast_kernels)
        logger.info(f"KV in host memory: {num_blocks} blocks ({gib:g} GiB); offloaded blocks are attended to "
                    f"through {OFFLOAD_SLOTS} slots of {engine.slot_blocks} blocks"
                    + ("; a prompt that outgrows the GPU alone is prefilled a layer at a time into host memory"
                       if self.layer_major is not None else ""))
        return host_pool

    def _preemption_policy(self, host_pool: HostKVPool) -> PreemptionPolicy:
        """preemption_mode as set, or (None) the swap-or-recompute costs measured now."""
        mode = self.config.preemption_mode
        if mode is not None:
            return PreemptionPolicy(mode)
        c, attn = self.hf_config, self.attention_layers[0]
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        layer_params = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
        return measured_policy(self.kv_cache, host_pool.pool, 2 * c.num_hidden_layers * layer_params)

    # ---- one step -------------------------------------------------------------------------------
    def _to_device(self, array, dtype) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(array, dtype=np.int64 if dtype == torch.int64 else None)).to(dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare_inputs(self, seqs: list[Sequence]):
        bs = self.block_size
        num_new = [s.num_scheduled_tokens for s in seqs]
        starts = [0, *itertools.accumulate(num_new)]
        n, b, max_query_len = starts[-1], len(seqs), max(num_new)
        width = _round_up(max(len(s.block_table) for s in seqs), ALIGN)
        tiles = prefill_tiles(num_new, prefill_tile_tokens(self.gqa_group)) if max_query_len > 1 else None
        # One host-to-device copy for the whole step's integers, cut into views on the device. Every view
        # starts 64-byte aligned and the 2-D views' row strides are multiples of 16, so the Triton kernels, which
        # specialize on pointer alignment and stride divisibility, never compile a variant mid-run.
        n_pad, b_pad = _round_up(n, ALIGN // 2), _round_up(b + 1, ALIGN)
        t_pad = _round_up(tiles.shape[1], ALIGN) if tiles is not None else 0
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
        packed = self._to_device(host, torch.int64)
        small = packed[3 * n_pad:].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=packed[2 * n_pad:2 * n_pad + n], query_start_loc=small[:b + 1],
            seq_lens=small[b_pad:b_pad + b], block_tables=small[2 * b_pad:2 * b_pad + b * width].view(b, width),
            num_decodes=num_new.count(1), max_query_len=max_query_len, max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            prefill_tiles=small[2 * b_pad + b * width:].view(2, t_pad) if tiles is not None else None,
            offloaded=offloaded)
        return packed[:n], packed[n_pad:n_pad + n], meta

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [s.params for s in seqs]
        # every per-row knob in two arrays: two host-to-device copies a step instead of eleven
        floats = self._to_device(np.array([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                                            p.repetition_penalty] for p in params], dtype=np.float32).T.copy(),
                                 torch.float32)
        ints = self._to_device(np.array([[p.top_k or self.vocab_size, s.seed, s.num_output_tokens]
                                         for p, s in zip(params, seqs)], dtype=np.int64).T.copy(), torch.int64)
        counts = prompt_mask = None
        if any(p.has_penalties for p in params):
            counts, prompt_mask = self._token_occurrences(seqs)
        banned_rows, banned_ids = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                stops = self.stop_token_ids + seq.params.stop_token_ids
                banned_rows += [row] * len(stops)
                banned_ids += stops
        banned = self._to_device(np.array([banned_rows, banned_ids], dtype=np.int64), torch.int64) if banned_rows else None
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingTensors(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
            frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0], seeds=ints[1], steps=ints[2],
            output_counts=counts, prompt_mask=prompt_mask, banned=(banned[0], banned[1]) if banned_rows else None,
            all_greedy=all(p.greedy for p in params),
            any_top_k_p=any(p.top_k or p.top_p < 1 for p in params), any_min_p=any(p.min_p > 0 for p in params),
            max_logprobs=max(logprob_counts, default=-1))

    def _token_occurrences(self, seqs: list[Sequence]):
        """[B, V] counts of each output token and a mask of prompt tokens, built by scatter on device."""
        def padded(lists):
            width = max(1, max(len(x) for x in lists))
            out = np.full((len(lists), width), self.vocab_size, dtype=np.int64)  # the pad id lands in a spare column
            for i, x in enumerate(lists):
                out[i, :len(x)] = x
            return self._to_device(out, torch.int64)

        def occurrences(lists):
            ids = padded(lists)
            counts = torch.zeros(len(lists), self.vocab_size + 1, device=self.device)
            return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :-1]

        outputs = occurrences([s.output_token_ids for s in seqs])
        prompts = occurrences([s.token_ids[:s.num_prompt_tokens] for s in seqs]) > 0
        return outputs, prompts

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence],
               input_ids_from: tuple[torch.Tensor, list[int], list[int]] | None = None) -> StepHandle:
        """Start one step on the device and return without waiting for its tokens. `input_ids_from`
        (tokens, src, dst): input ids dst are rows src of a previous step's sampled tokens, still on the device
        (a pipelined step; the host holds placeholders for them)."""
        if self.steady is not None and self.steady.continues(seqs):
            return self._launch_steady()
        self.steady = None
        input_ids, positions, meta = self.prepare_inputs(seqs)
        if input_ids_from is not None:
            tokens, src, dst = input_ids_from
            if src == dst == list(range(input_ids.shape[0])) and len(src) == tokens.shape[0]:
                input_ids.copy_(tokens)  # a steady decode batch: every row, in the same order
            elif src:
                rows = self._to_device(np.array([src, dst], dtype=np.int64), torch.int64)
                input_ids.index_copy_(0, rows[1], tokens[rows[0]])
        self.bytes_read += self.weight_bytes + sum(meta.seq_lens_cpu) * self.kv_bytes_per_token
        hidden = all_logits = None
        if self.layer_major is not None and self.layer_major.takes(seqs):  # kvcache/layer_major.py
            seq = seqs[0]
            hidden = self.layer_major.run(input_ids, positions, seq.num_computed_tokens, seq.host_blocks,
                                          seq.block_table[len(seq.host_blocks):])
        elif meta.offloaded is not None:  # attention over host blocks runs eagerly (kvcache/offload_engine.py)
            hidden = self.model(input_ids, positions, meta)
        elif self.graphs is not None and meta.num_decodes == len(seqs) and self.graphs.can_run(len(seqs)):
            all_logits = self.graphs.run(input_ids, positions, meta)
        elif self.prefill_graphs is not None and self.prefill_graphs.can_run(meta, input_ids.shape[0]):
            hidden = self.prefill_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        handle = StepHandle(seqs, self._prompt_logprobs(seqs, hidden, meta.query_start_loc_cpu),
                            [i for i, s in enumerate(seqs) if s.is_prefill_done])
        if handle.sample_idx:
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
                    logits = self._compute_logits(hidden, [meta.query_start_loc_cpu[i + 1] - 1
                                                           for i in handle.sample_idx])
                handle.tokens, handle.raw_logprobs = self.sampler(logits, tensors)
                if steady:
                    self.graphs.advance(handle.tokens, tensors.steps)
            if steady:
                self.steady = SteadyDecode(seqs, [len(s.block_table) for s in seqs], sum(meta.seq_lens_cpu),
                                           meta.max_seq_len, None if tensors.temperature_only else tensors)
            handle.max_logprobs = tensors.max_logprobs
            self._read_back(handle, from_ring=steady)
        return handle

    def _launch_steady(self) -> StepHandle:
        """The steady batch's next decode step: its new KV blocks, then the decode graph and its sampling (the
        sampling graph, or the eager sampler and the advance kernel)."""
        steady = self.steady
        seqs = steady.seqs
        entries = steady.new_blocks()
        if entries:
            rows, columns, block_ids = self._to_device(np.array(entries, dtype=np.int64).T.copy(), torch.int64)
            self.graphs.set_blocks(rows, columns, block_ids)
        steady.context_tokens += len(seqs)
        steady.max_seq_len += 1
        self.bytes_read += self.weight_bytes + steady.context_tokens * self.kv_bytes_per_token
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
            lp = (self._gather_logprobs(handle.raw_logprobs, handle.tokens, handle.max_logprobs)
                  if handle.raw_logprobs is not None else None)
            for j, i in enumerate(handle.sample_idx):
                sampled[i] = token_list[j]
                if lp is not None and seqs[i].params.logprobs is not None:
                    logprobs[i] = lp[j]
        return RunnerOutput(sampled, logprobs, handle.prompt_logprobs)

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
        """Per row: the target's logprob and rank (1 = most likely), and the top-k."""
        chosen = logprobs.gather(1, targets[:, None])
        ranks = (logprobs > chosen).sum(1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (chosen[:, :0], targets[:, None][:, :0])
        return [TokenLogprobs(t, c, r, ids, lps) for t, c, r, ids, lps in
                zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())]

    def _prompt_logprobs(self, seqs, hidden, starts) -> list[list[TokenLogprobs]]:
        """Log-likelihood of each prompt token given the ones before, a chunk of rows at a time."""
        out: list[list[TokenLogprobs]] = [[] for _ in seqs]
        rows, targets, owners = [], [], []
        for i, seq in enumerate(seqs):
            if not seq.wants_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
            for pos in range(start, end):
                rows.append(starts[i] + pos - start)
                targets.append(seq.token_ids[pos + 1])
                owners.append(i)
        k = max((seqs[i].params.prompt_logprobs for i in set(owners)), default=0)
        for c in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
            chunk = slice(c, c + PROMPT_LOGPROBS_CHUNK)
            logits = self.model.compute_logits(hidden[self._to_device(rows[chunk], torch.int64)])
            entries = self._gather_logprobs(logits.float().log_softmax(-1), self._to_device(targets[chunk], torch.int64), k)
            for owner, entry in zip(owners[chunk], entries):
                out[owner].append(entry)
        return out
