"""Where each decoder layer's weights live: resident on the device, in host memory (vLLM's `cpu_offload_gb`: that
many GiB of the weights) or on disk (`disk_offload_gb`), the last two streamed to the device before the layer runs.
The streamed layers are spread evenly among the resident ones, so that the link loads the next streamed layer while
the resident layers before it compute; a run of resident layers would leave the link idle that long (measured:
Llama-3-8B Q4_K with its first 25% streamed decoded batch 64 at 71% of the link's bound). The embedding, the final
norm and the LM head stay resident."""
import math
from dataclasses import dataclass

import torch


@dataclass
class Placement:
    layer_bytes: list[int]  # weight bytes of each decoder layer
    disk: list[int]  # the decoder layers read from disk
    host: list[int]  # the decoder layers held in host memory

    @property
    def streamed(self) -> list[int]:
        """In the order they run."""
        return sorted(self.disk + self.host)

    def bytes_of(self, layers: list[int]) -> int:
        return sum(self.layer_bytes[i] for i in layers)

    def table(self, host_to_device_bandwidth: float | None = None, disk_bandwidth: float | None = None) -> str:
        """The plan, a row a tier, and the bound it sets on a step (each tier's bytes over its bandwidth)."""
        resident = [i for i in range(len(self.layer_bytes)) if i not in self.streamed]
        rows = [f"| {tier} | {len(layers)} | {self.bytes_of(layers) / (1 << 30):.2f} GiB |"
                for tier, layers in (("device", resident), ("host memory", self.host), ("disk", self.disk))]
        bound = ""
        if host_to_device_bandwidth and self.streamed:
            seconds = self.bytes_of(self.streamed) / host_to_device_bandwidth
            if disk_bandwidth and self.disk:
                seconds += self.bytes_of(self.disk) / disk_bandwidth
            bound = f"\nstreaming bound: {seconds * 1e3:.1f} ms a step ({1 / seconds:.1f} steps/s)"
        return "| decoder layers in | count | weights |\n|---|---|---|\n" + "\n".join(rows) + bound


def plan_placement(layer_bytes: list[int], cpu_offload_bytes: int, disk_offload_bytes: int = 0) -> Placement:
    """The fewest whole layers, evenly spaced, that hold disk_offload_bytes on disk and cpu_offload_bytes in host
    memory (at least that much each); the disk's evenly spaced among them."""
    for name, value in (("cpu_offload_gb", cpu_offload_bytes), ("disk_offload_gb", disk_offload_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value / (1 << 30):g}")
    count = len(layer_bytes)
    for n in range(count + 1):
        streamed = evenly(list(range(count)), n)
        disk = fewest_evenly(streamed, layer_bytes, disk_offload_bytes)
        host = [i for i in streamed if i not in disk]
        held = sum(layer_bytes[i] for i in disk), sum(layer_bytes[i] for i in host)
        if n == count or (held[0] >= disk_offload_bytes and held[1] >= cpu_offload_bytes):
            return Placement(list(layer_bytes), disk, host)


def fewest_evenly(items: list[int], layer_bytes: list[int], need: int) -> list[int]:
    """The fewest of the items, evenly spaced, whose layers hold `need` bytes (all of them where none do)."""
    for k in range(len(items) + 1):
        chosen = evenly(items, k)
        if sum(layer_bytes[i] for i in chosen) >= need:
            return chosen
    return list(items)


def evenly(items: list[int], k: int) -> list[int]:
    """k of the items, evenly spaced, the first included."""
    return [items[j * len(items) // k] for j in range(k)]


def weights_do_not_fit(model_config, device: torch.device, tensor_parallel_size: int,
                       free_bytes: int | None) -> torch.OutOfMemoryError:
    """The error for a model whose weights ran the device out of memory at load: how large they are (the dense
    parameters; quantized ones take less) against what was free, and the settings that make room."""
    from nanovllm.weights.synthetic import weight_shapes

    params = sum(math.prod(shape) for shape in weight_shapes(model_config.hf_config.to_dict()).values())
    gib = 1 << 30
    dense = params * model_config.dtype.itemsize / tensor_parallel_size / gib
    free = "" if free_bytes is None else f", against {free_bytes / gib:.1f} GiB free"
    return torch.OutOfMemoryError(
        f"the model's weights do not fit on {device} ({params / 1e9:.1f}B parameters: {dense:.1f} GiB "
        f"{'a GPU ' if tensor_parallel_size > 1 else ''}at {str(model_config.dtype).removeprefix('torch.')} before "
        f"any quantization{free}): stream decoder layers from host memory (cpu_offload_gb=GiB) or disk "
        f"(disk_offload_gb=GiB), quantize them (quantization='int4', 'int8' or 'fp8'), or split the model over "
        f"GPUs (tensor_parallel_size)")
