"""The execution plan: every start-up decision of how steps run, made once from Config and the device, read by the
components and never re-derived, and logged once as one table."""
import dataclasses
from dataclasses import dataclass

import torch

from nanovllm.kvcache.kv_cache import KVCacheLayout


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    fast_kernels: bool  # the fused Triton layers, GEMV and sampler: every GPU backend but the torch reference
    linear_method: str  # "onednn" (packed fp32 on CPU), "gemv" (Triton up to 64 rows, cuBLAS above), "torch"
    pdl_off: str | None  # why the Triton kernels launch without programmatic dependent launch (None: with it)
    graphs_off: str | None  # why steps run eagerly (None: decode steps replay CUDA graphs)
    prefill_graphs: bool  # steps with prefills replay CUDA graphs too
    weights: str  # where the decoder layers' weights live
    tensor_parallel_size: int
    kv: KVCacheLayout | None = None  # set once the KV cache is sized

    @property
    def cuda_graphs(self) -> bool:
        return self.graphs_off is None

    @classmethod
    def decide(cls, config, model, backend, streamer) -> "ExecutionPlan":
        device, dtype = torch.device(config.device), config.model_config.dtype
        fast = device.type == "cuda" and backend.name != "torch"
        graphs_off = _graphs_off(config, device, model, backend, streamer)
        return cls(device, dtype, backend.name, fast, _linear_method(device, dtype, fast), _pdl_off(device, fast),
                   graphs_off, graphs_off is None and backend.supports_prefill_graphs and model.supports_prefill_graphs,
                   _weights(streamer, device),
                   config.tensor_parallel_size)

    def with_kv(self, kv: KVCacheLayout) -> "ExecutionPlan":
        return dataclasses.replace(self, kv=kv)

    def table(self, max_model_len: int) -> str:
        linears = {"onednn": "oneDNN packed fp32", "gemv": "Triton GEMV up to 64 rows, cuBLAS above",
                   "torch": "F.linear" if self.device.type == "cpu" else "cuBLAS"}[self.linear_method]
        kernels = "fused Triton layers" + (", PDL" if self.pdl_off is None else f", no PDL ({self.pdl_off})") \
            if self.fast_kernels else "plain torch"
        graphs = ("decode and prefill steps" if self.prefill_graphs else "decode steps") if self.cuda_graphs \
            else f"off ({self.graphs_off})"
        rows = [("dtype", str(self.dtype).removeprefix("torch.")), ("attention", self.attention_backend),
                ("kernels", kernels), ("linears", linears), ("CUDA graphs", graphs), ("weights", self.weights)]
        if self.kv is not None:
            rows.append(("KV cache", self.kv.describe(self.device, max_model_len)))
        if self.tensor_parallel_size > 1:
            rows.append(("tensor parallel", f"{self.tensor_parallel_size} ranks"))
        width = max(len(name) for name, _ in rows)
        return "execution plan:\n" + "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _weights(streamer, device: torch.device) -> str:
    return f"every layer on {device}" if streamer is None else streamer.describe(device)


def _graphs_off(config, device: torch.device, model, backend, streamer) -> str | None:
    if device.type != "cuda":
        return "not on CUDA"
    if config.enforce_eager:
        return "enforce_eager=True"
    if not model.supports_cuda_graphs:
        return f"{type(model).__name__}'s layers run eagerly"
    if streamer is not None:
        return "weights stream in (cpu_offload_gb / disk_offload_gb)"
    if not backend.supports_cuda_graphs:
        return f"the {backend.name} attention backend cannot be captured"
    return None


def _linear_method(device: torch.device, dtype: torch.dtype, fast: bool) -> str:
    if device.type == "cpu" and dtype == torch.float32:
        from nanovllm.layers.linear import CpuPackedLinearMethod

        return "onednn" if CpuPackedLinearMethod.available() else "torch"
    return "gemv" if fast and dtype != torch.float32 else "torch"


def _pdl_off(device: torch.device, fast: bool) -> str | None:
    if not fast:
        return "no Triton kernels"
    from nanovllm.kernels import pdl

    return pdl.why_off(device)
