"""Where each decoder layer's weights live: resident on the device, in host memory (vLLM's `cpu_offload_gb`: that
many GiB of the weights) or on disk (`disk_offload_gb`), the last two streamed to the device before the layer runs.
The first layers go to disk, the next to host memory. The embedding, the final norm and the LM head stay resident."""
from dataclasses import dataclass


@dataclass
class Placement:
    layer_bytes: list[int]  # weight bytes of each decoder layer
    disk: list[int]  # the decoder layers read from disk
    host: list[int]  # the decoder layers held in host memory

    @property
    def streamed(self) -> list[int]:
        return self.disk + self.host

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
    """Whole layers from the first on: to disk until they hold disk_offload_bytes, then to host memory until those
    hold cpu_offload_bytes (at least that much each)."""
    for name, value in (("cpu_offload_gb", cpu_offload_bytes), ("disk_offload_gb", disk_offload_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value / (1 << 30):g}")
    tiers: dict[str, list[int]] = {"disk": [], "host": []}
    budgets = {"disk": disk_offload_bytes, "host": cpu_offload_bytes}
    held = dict.fromkeys(tiers, 0)
    for i, size in enumerate(layer_bytes):
        tier = next((t for t in ("disk", "host") if held[t] < budgets[t]), None)
        if tier is None:
            break
        tiers[tier].append(i)
        held[tier] += size
    return Placement(list(layer_bytes), tiers["disk"], tiers["host"])
