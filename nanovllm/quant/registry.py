"""The quantization config of a resolved `quantization` name (vLLM's get_quantization_config)."""
import torch

from nanovllm.quant.base_config import QuantizationConfig
from nanovllm.quant.gguf_linear import GGUFConfig
from nanovllm.quant.per_channel import PerChannelConfig


def get_quantization_config(name: str | None, device: torch.device, dtype: torch.dtype,
                            use_kernels: bool) -> QuantizationConfig | None:
    """The config of a resolved `quantization` (Config: "gguf", "fp8", "int8", "int4" or None for dense)."""
    if name in ("gguf", "int4"):
        return GGUFConfig(device, dtype, use_kernels, int4=name == "int4")
    if name in ("fp8", "int8"):
        return PerChannelConfig(name, device, dtype, use_kernels)
    return None
