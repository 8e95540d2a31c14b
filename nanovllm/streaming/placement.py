"""Where each decoder layer's weights live: resident on the device, or in host memory and streamed to the device
before the layer runs (vLLM's `cpu_offload_gb`: that many GiB of the weights live in host memory). The embedding,
the final norm and the LM head stay resident."""
from dataclasses import dataclass


@dataclass
class Placement:
    layer_bytes: list[int]  # weight bytes of each decoder layer
    streamed: list[int]  # the decoder layers held in host memory, in the order they run

    @property
    def streamed_bytes(self) -> int:
        return sum(self.layer_bytes[i] for i in self.streamed)

    def table(self, host_to_device_bandwidth: float | None = None) -> str:
        """The plan, one row a tier, and the bound it sets on a step (bytes streamed a step over the link)."""
        resident = len(self.layer_bytes) - len(self.streamed)
        rows = [f"| device | {resident} | {(sum(self.layer_bytes) - self.streamed_bytes) / (1 << 30):.2f} GiB |",
                f"| host memory | {len(self.streamed)} | {self.streamed_bytes / (1 << 30):.2f} GiB |"]
        bound = ""
        if host_to_device_bandwidth and self.streamed:
            seconds = self.streamed_bytes / host_to_device_bandwidth
            bound = f"\nstreaming bound: {seconds * 1e3:.1f} ms a step ({1 / seconds:.1f} steps/s)"
        return "| decoder layers in | count | weights |\n|---|---|---|\n" + "\n".join(rows) + bound


def plan_placement(layer_bytes: list[int], cpu_offload_bytes: int) -> Placement:
    """The first layers go to host memory until they hold cpu_offload_bytes (whole layers, at least that much)."""
    if cpu_offload_bytes < 0:
        raise ValueError(f"cpu_offload_gb must be >= 0, got {cpu_offload_bytes / (1 << 30):g}")
    streamed, held = [], 0
    for i, size in enumerate(layer_bytes):
        if held >= cpu_offload_bytes:
            break
        streamed.append(i)
        held += size
    return Placement(list(layer_bytes), streamed)
