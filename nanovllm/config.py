import logging
import os
from dataclasses import dataclass, field, fields

import torch

from nanovllm.logger import log_once
from nanovllm.platform import default_block_size, why_no_fp8
from nanovllm.rope_scaling import rope_parameters, scaled_max_positions
from nanovllm.weights.model_files import LOAD_FORMATS, load_model_config

AT_LOAD = ("fp8", "int8", "int4")  # quantization of a 16-bit checkpoint at load
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def _require(ok: bool, message: str):
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    """What the engine knows of the model: its HF config, where it lives, and the resolved sizes."""

    model: str
    format: str  # "safetensors" | "gguf" | "dummy" (weights drawn at load: weights/model_files.py)
    hf_config: object
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str | None = None
    quantization: str | None = None  # "gguf": the file's quantized weights stay quantized; None: dense

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def require_gpus(device: str, count: int, setting: str):
    """A setting that takes `count` GPUs, one a process: at most as many as torch sees (on CPU, processes are not
    GPUs)."""
    if device.startswith("cuda"):
        _require(count <= torch.cuda.device_count(), f"{setting} takes {count} GPUs but torch sees "
                 f"{torch.cuda.device_count()}: lower it")


@dataclass
class Config:
    """Every engine setting, validated once: an error names the field and the fix."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: 256
    max_num_batched_tokens: int | None = None  # None: 1024 on CPU (a chunk's activations stay in cache), 16384 on GPU
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU default: 4 GiB, as vLLM's VLLM_CPU_KVCACHE_SPACE
    num_gpu_blocks_override: int | None = None
    block_size: int | None = None  # None: 256 where flash_attn will run (its paged kernels need it), else 16
    enable_prefix_caching: bool | None = True  # None: True (vLLM's scripts pass None)
    enforce_eager: bool = False
    async_scheduling: bool = True  # launch a decode batch's next step before reading its tokens back
    seed: int | None = 0  # None: 0
    attention_backend: str | None = None  # None: the device's default
    # None: a .gguf file's weights stay quantized on CUDA ("gguf"), and are dequantized at load on CPU, where the
    # kept-quantized path is slower; "gguf": kept quantized on either; "none": dense; "fp8", "int8", "int4": a
    # 16-bit checkpoint quantized at load (quant/quantize.py says how)
    quantization: str | None = None
    kv_offloading_size: float | None = None  # GiB of host memory for KV blocks (docs/offloading.md); None: none
    kv_offloading_backend: str | None = None  # "native" (the only one) or None
    # with kv_offloading_size, what a preempted sequence's KV does: "swap" (to host memory and back), "recompute",
    # or None: the cheaper of the two, as measured at start-up (kvcache/preemption.py). Without it: recompute
    preemption_mode: str | None = None
    cpu_offload_gb: float = 0  # GiB of decoder-layer weights held in host memory and streamed in (vLLM's name)
    disk_offload_gb: float = 0  # GiB of decoder-layer weights read from a file in offload_folder as they run
    offload_folder: str | None = None  # None: NANOVLLM_CACHE (default ~/.cache/nanovllm) / offload
    tensor_parallel_size: int = 1  # processes the model's heads and rows are split over (GPUs, or CPU processes)
    data_parallel_size: int = 1  # engines, each in its own process (and GPUs), that a call's requests are dealt to
    disable_custom_all_reduce: bool = False  # True: every all-reduce between GPUs runs NCCL (vLLM's name)
    load_format: str = "auto"  # vLLM's: "auto", "safetensors", "gguf", or "dummy" (random weights at real shapes)
    model_config: ModelConfig = field(init=False)

    def __post_init__(self):
        self.device = self._resolve_device(self.device)
        self.max_num_seqs = 256 if self.max_num_seqs is None else self.max_num_seqs
        self.enable_prefix_caching = self.enable_prefix_caching is not False
        self.seed = 0 if self.seed is None else self.seed
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_num_seqs, 1024 if self.device == "cpu" else 16384)
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                 f"({self.max_num_seqs}): every running sequence needs one token a step")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 f"num_gpu_blocks_override must be None or >= 1, got {self.num_gpu_blocks_override}")
        _require(self.kv_offloading_size is None or self.kv_offloading_size > 0,
                 f"kv_offloading_size must be None or > 0 (GiB), got {self.kv_offloading_size}")
        _require(self.kv_offloading_backend in (None, "native"),
                 f"kv_offloading_backend must be None or 'native', got {self.kv_offloading_backend!r}")
        _require(self.preemption_mode in (None, "swap", "recompute"),
                 f"preemption_mode must be None, 'swap' or 'recompute', got {self.preemption_mode!r}")
        _require(self.preemption_mode != "swap" or self.kv_offloading_size is not None,
                 "preemption_mode='swap' copies KV to host memory: set kv_offloading_size (GiB) too")
        _require(self.cpu_offload_gb >= 0, f"cpu_offload_gb must be >= 0 (GiB), got {self.cpu_offload_gb}")
        _require(self.disk_offload_gb >= 0, f"disk_offload_gb must be >= 0 (GiB), got {self.disk_offload_gb}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 f"kv_cache_memory_bytes must be None or > 0, got {self.kv_cache_memory_bytes}")
        _require(self.load_format in LOAD_FORMATS, f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                 f"{self.load_format!r}")
        hf_config, fmt = load_model_config(self.model, self.load_format)
        quantization = self._resolve_quantization(fmt, hf_config)
        dtype = self._resolve_dtype(hf_config, fmt, quantization)
        if self.block_size is None:
            self.block_size = default_block_size(self.device, self.attention_backend, dtype)
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 f"block_size must be a power of two from 1 to 256, got {self.block_size}")
        self._check_tensor_parallel(hf_config)
        _require(self.preemption_mode != "swap" or "linear_attention" not in (getattr(hf_config, "layer_types", None)
                                                                               or []),
                 f"preemption_mode='swap' is not supported for a model with linear-attention layers "
                 f"({hf_config.architectures[0]}): their state is not kept while a sequence is swapped out; use "
                 "'recompute' or None")
        self._check_data_parallel()
        max_model_len = self._resolve_max_model_len(hf_config)
        self.model_config = ModelConfig(os.fspath(self.model), fmt, hf_config, dtype, max_model_len,
                                        self.tokenizer, quantization)

    def _check_tensor_parallel(self, hf_config):
        size = self.tensor_parallel_size
        _require(isinstance(size, int) and size >= 1, f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if size == 1:
            return
        require_gpus(self.device, size, "tensor_parallel_size")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            value = getattr(hf_config, name, None)
            _require(value is None or value % size == 0,
                     f"tensor_parallel_size={size} does not divide the model's {name} ({value}): choose a divisor")

    def _check_data_parallel(self):
        size = self.data_parallel_size
        _require(isinstance(size, int) and size >= 1, f"data_parallel_size must be an integer >= 1, got {size!r}")
        if size > 1:  # each replica takes tensor_parallel_size GPUs
            require_gpus(self.device, size * self.tensor_parallel_size,
                         f"data_parallel_size x tensor_parallel_size = {size} x {self.tensor_parallel_size}")

    @staticmethod
    def _resolve_device(device: str) -> str:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        _require(device in ("cpu", "cuda") or device.startswith("cuda:"),
                 f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if device.startswith("cuda"):
            _require(torch.cuda.is_available(), "device='cuda' but torch sees no CUDA GPU; use device='cpu'")
        return device

    def _resolve_quantization(self, fmt: str, hf_config) -> str | None:
        q = self.quantization
        _require(q in (None, "gguf", "none", *AT_LOAD),
                 f"quantization must be None, 'gguf', 'none', 'fp8', 'int8' or 'int4', got {q!r}")
        if q in AT_LOAD:
            _require(fmt != "gguf", f"quantization={q!r} asks to quantize a 16-bit checkpoint, but {self.model} is a "
                                    "GGUF file, already quantized; pass quantization=None to keep its types")
            if q == "fp8":
                why_not = why_no_fp8(torch.device(self.device))
                _require(why_not is None, f"{why_not}; use quantization='int8' or 'int4'")
        if q == "gguf" and fmt == "dummy":  # experts drawn as random Q4_K blocks (weights/model_files.py)
            _require(getattr(hf_config, "num_experts", 0) > 0,
                     f"load_format='dummy' with quantization='gguf' draws a mixture's experts as Q4_K blocks; "
                     f"{hf_config.architectures[0]} has no experts")
        elif q == "gguf":
            _require(fmt == "gguf", f"quantization='gguf' needs a .gguf model file; {self.model} is {fmt}")
        if q is None and fmt == "gguf":
            if self.device != "cpu":
                q = "gguf"
            else:  # bf16 activations (quant/cpu_int4.py) give other greedy tokens than HF's fp32 on SmolLM2
                log_once("GGUF on CPU: weights dequantized to fp32 at load (HF's greedy tokens); quantization='gguf' "
                         "keeps them quantized, faster and in less memory, with bf16 activations", logging.DEBUG)
        return None if q == "none" else q

    def _resolve_dtype(self, hf_config, fmt: str, quantization: str | None) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            dtype = self.dtype
        elif self.dtype == "auto":
            if self.device == "cpu":
                dtype = torch.float32  # exact vs HF (bf16 breaks SmolLM2's near ties other ways than fp32)
            else:
                dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
                dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
                if fmt == "gguf":  # fp16 agrees with HF fp32 far more often than bf16 on GGUF files (docs)
                    dtype = torch.float16
                elif quantization == "int4":  # as vLLM's 4-bit kernels; the CUDA one-row GEMV takes fp16
                    dtype = torch.float16
                elif dtype not in (torch.float16, torch.bfloat16):
                    dtype = torch.bfloat16
            log_once(f"dtype='auto' resolved to {dtype} on {self.device}", logging.DEBUG)
        else:
            _require(self.dtype in _DTYPES, f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
            dtype = _DTYPES[self.dtype]
        _require(dtype in (torch.float32, torch.float16, torch.bfloat16),
                 f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype

    def _resolve_max_model_len(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None)
        if limit is not None:  # rope scaling reaches further (yarn: the original context times its factor)
            limit = scaled_max_positions(rope_parameters(hf_config), limit)
        if self.max_model_len is None:
            _require(limit is not None, "the model config has no max_position_embeddings: pass max_model_len")
            return limit
        _require(isinstance(self.max_model_len, int) and self.max_model_len >= 1,
                 f"max_model_len must be an integer >= 1, got {self.max_model_len}")
        _require(limit is None or self.max_model_len <= limit,
                 f"max_model_len ({self.max_model_len}) is larger than the model's context ({limit}: its "
                 "max_position_embeddings, times its rope scaling factor where it has one)")
        return self.max_model_len


def engine_arg_names() -> list[str]:
    """The engine arguments, the one list: Config's fields but model. LLM(), run-batch's flags and the README's
    LLM() line follow it."""
    return [f.name for f in fields(Config) if f.init and f.name != "model"]
