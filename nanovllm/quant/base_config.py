"""What the model's construction and loading ask of a quantization (vLLM's QuantizationConfig): the linear method
of each projection, whether the embedding and LM head follow it, and, once the weights are loaded, each layer's
final form with a log table of which path serves which layer."""
from collections import Counter

import torch
from torch import nn

from nanovllm.logger import logger


def rows_per_chunk(x: torch.Tensor, k: int) -> int:
    """Rows of a [N, k] quantized weight that a torch twin converts at a time: all on CUDA; 1 MB of fp32 on CPU, so
    that no dense copy of a weight is ever whole in RAM (8 MB: 1.5x the peak RSS, no faster)."""
    return 1 << 62 if x.is_cuda else max(1, (1 << 20) // (4 * k))


class QuantizationConfig:
    # the embedding and LM head follow the checkpoint's own quantization (GGUF); False: they stay dense, as vLLM keeps
    # them for weights quantized at load
    quantize_embeddings = False
    device: torch.device
    load_device: torch.device | None = None  # where layers' weights are made at load (host memory when they stream)

    @property
    def weights_device(self) -> torch.device:
        return self.load_device or self.device

    def linear_method(self):
        raise NotImplementedError

    def describe(self) -> str:
        """What the load log calls these weights."""
        raise NotImplementedError

    def finish_loading(self, model: nn.Module):
        """Each of this config's layers takes its final form (process_weights_after_loading returns the path that
        serves it); then the log prints which path serves what."""
        paths = Counter()
        for name, module in model.named_modules():
            method = getattr(module, "linear_method", None)
            if getattr(method, "config", None) is self:
                paths[(name.rsplit(".", 1)[-1], method.process_weights_after_loading(module))] += 1
        if paths:
            rows = "\n".join(f"  {kind:<14} x{count:<4} {path}" for (kind, path), count in sorted(paths.items()))
            logger.info(f"{self.describe()} (layer, count, path):\n{rows}")

