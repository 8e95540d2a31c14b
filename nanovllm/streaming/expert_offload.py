"""Experts past the GPU. With cpu_offload_gb / disk_offload_gb on a mixture-of-experts model the unit of placement is
the expert: the layers' dense parts (attention, norms, router, shared expert) and the embeddings stay resident, and
in each MoE layer as many experts as the budgets leave stay on the device while the rest live in host memory (pinned
on CUDA) or in a file in offload_folder; a GGUF file's experts stay in their blocks (the unit moved is an expert's
blocks). A step runs a layer's router, its resident experts on the pairs routed to them, then loads the union of the
batch's routed non-resident experts into a device pool shared by the layers (host ones in one gathered copy a stack,
disk ones by positional reads through a pinned staging buffer) and runs them on theirs. Which experts are resident
follows the routing counts seen so far, revised every `revise_every` forwards of a layer (between the device and
host memory; disk experts stay on disk). Steps run eagerly: the routed experts are read on the host. On CPU the same
bookkeeping, with host tensors as the "device", tested in CI."""
import math
from dataclasses import dataclass

import torch

from nanovllm.cache_dir import cache_dir
from nanovllm.host_memory import require_disk_space, require_host_memory
from nanovllm.logger import log_once, logger
from nanovllm.streaming.layer_file import LayerFile, aligned

REVISE_EVERY = 64  # forwards of a layer between two revisions of its resident experts


@dataclass(frozen=True)
class ExpertPlacement:
    num_layers: int  # MoE layers
    num_experts: int  # a layer
    expert_bytes: int
    host: int  # experts a layer in host memory
    disk: int = 0  # experts a layer on disk

    @classmethod
    def plan(cls, num_layers: int, num_experts: int, expert_bytes: int, host_bytes: int,
             disk_bytes: int = 0) -> "ExpertPlacement":
        """The fewest experts a layer, the same in every layer, that hold disk_bytes on disk and host_bytes in host
        memory (at least that much each)."""
        def per_layer(nbytes: int) -> int:
            return math.ceil(nbytes / max(1, expert_bytes * num_layers))

        disk = min(num_experts, per_layer(disk_bytes))
        return cls(num_layers, num_experts, expert_bytes, min(num_experts - disk, per_layer(host_bytes)), disk)

    @property
    def resident(self) -> int:
        return self.num_experts - self.host - self.disk

    @property
    def offloaded(self) -> int:
        return self.host + self.disk

    def table(self, top_k: int) -> str:
        """The tiers, and the bytes a token's routed experts past the device weigh where routing is uniform (the
        worst case for the resident set): a bs=1 step moves them over the link, which bounds it."""
        gib = self.expert_bytes * self.num_layers / (1 << 30)
        past = top_k * self.offloaded / self.num_experts * self.expert_bytes  # a layer
        return "| experts in | a layer | all layers |\n|---|---|---|\n" + "\n".join(
            f"| {tier} | {n} | {n * gib:.2f} GiB |" for tier, n in
            (("device", self.resident), ("host memory", self.host), ("disk", self.disk))) + \
            (f"\na token's routed experts past the device, routing uniform: {past / 1e6:.1f} MB a layer, "
             f"{past * self.num_layers / 1e9:.2f} GB a token (a bs=1 step's bound: that over the link's bandwidth)")


class ExpertPool:
    """Device rows that a layer's routed non-resident experts are copied into, shared by the layers (they run one
    after another), with the pinned staging buffers that gather them on the host. Its stacks are a layer's
    (FusedMoE.stacks(): dense w13 and w2, or a GGUF file's blocks), an expert a row."""

    def __init__(self, rows: int, like: dict[str, torch.Tensor], device: torch.device):
        self.cuda = device.type == "cuda"
        self.stacks = {name: torch.empty(rows, *t.shape[1:], dtype=t.dtype, device=device) for name, t in like.items()}
        self.stage = {name: torch.empty(rows, *t.shape[1:], dtype=t.dtype, pin_memory=True)
                      for name, t in like.items()} if self.cuda else self.stacks
        self.copied = torch.cuda.Event() if self.cuda else None
        self.num_loaded = 0  # statistics: experts copied in

    def load(self, host: dict[str, torch.Tensor], host_rows: list[int], read_disk=None,
             num_disk: int = 0) -> dict[str, torch.Tensor]:
        """Experts into the pool's first rows: rows host_rows of the host stacks, then num_disk that read_disk(i,
        {name: its row}) fills from disk."""
        n = len(host_rows) + num_disk
        self.num_loaded += n
        if self.cuda:
            self.copied.synchronize()  # the staging rows of the layer before have reached the device
        if host_rows:
            index = torch.tensor(host_rows)
            for name, stage in self.stage.items():
                torch.index_select(host[name], 0, index, out=stage[:len(host_rows)])
        for i in range(num_disk):
            read_disk(i, {name: stage[len(host_rows) + i] for name, stage in self.stage.items()})
        if self.cuda:
            for name, stack in self.stacks.items():
                stack[:n].copy_(self.stage[name][:n], non_blocking=True)
            self.copied.record()
        return {name: stack[:n] for name, stack in self.stacks.items()}


class LayerExperts:
    """One MoE layer's experts: its resident ones held by its FusedMoE, the host tier's in host memory (host_row_of:
    an expert's row there), the disk tier's in the layer file. Each expert is in one place: a revision swaps an
    expert that leaves the device with one that enters it."""

    def __init__(self, moe, placement: ExpertPlacement, pool: ExpertPool, device: torch.device, revise_every: int,
                 layer_file: LayerFile | None, key: int):
        self.pool, self.revise_every, self.layer_file, self.key = pool, revise_every, layer_file, key
        num_experts, in_host = placement.num_experts, placement.num_experts - placement.disk
        stacks = moe.stacks()
        self.names = list(stacks)
        if placement.disk:
            for e in range(in_host, num_experts):  # each stack's row at its own aligned offset
                for j, name in enumerate(self.names):
                    layer_file.write(self._place(e, j), stacks[name][e].contiguous().view(-1).view(torch.uint8))
        pin, resident = device.type == "cuda", placement.resident
        self.host = {name: t[resident:in_host].pin_memory() if pin else t[resident:in_host].clone()
                     for name, t in stacks.items()}
        self.host_row_of = {e: e - resident for e in range(resident, in_host)}
        self.resident = list(range(resident))
        moe.hold({name: t[:resident].to(device, copy=True) for name, t in stacks.items()})
        self.row_of = torch.full((num_experts,), -1, dtype=torch.int64, device=device)  # resident expert -> its row
        self.row_of[:resident] = torch.arange(resident, device=device)
        self.in_host = in_host  # experts 0..in_host-1 are on the device or in host memory; the rest are on disk
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)  # routed pairs seen, an expert
        self.forwards = 0
        self._staging: torch.Tensor | None = None  # whole pages a disk read lands in

    def _place(self, expert: int, stack: int) -> int:
        return len(self.names) * (self.key + expert) + stack

    def run(self, moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = self.row_of[ids]
        out = moe.run_held(x, weights, rows) if self.resident else torch.zeros_like(x)
        needed = ids[rows < 0].unique().tolist()
        if needed:
            host = [e for e in needed if e < self.in_host]
            disk = [e for e in needed if e >= self.in_host]
            loaded = self.pool.load(self.host, [self.host_row_of[e] for e in host],
                                    lambda i, rows_of: self._read(disk[i], rows_of), len(disk))
            pool_row = torch.full_like(self.row_of, -1)
            pool_row[host + disk] = torch.arange(len(needed), device=ids.device)
            out = out + moe.run_held(x, weights, pool_row[ids], loaded)
        self.counts.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        self.forwards += 1
        if self.resident and self.forwards % self.revise_every == 0:
            self.revise(moe)
        return out

    def _read(self, expert: int, rows: dict[str, torch.Tensor]):
        """A disk expert's stacks' rows into host rows (a staging buffer of whole pages between)."""
        for j, name in enumerate(self.names):
            row = rows[name]
            nbytes = row.numel() * row.element_size()
            if self._staging is None or self._staging.numel() < aligned(nbytes):
                self._staging = torch.empty(aligned(nbytes), dtype=torch.uint8, pin_memory=row.is_pinned())
            self.layer_file.read_into(self._place(expert, j), self._staging)
            row.view(-1).view(torch.uint8).copy_(self._staging[:nbytes])

    def revise(self, moe):
        """The most routed experts so far of those on the device or in host memory become the resident ones: each
        that enters swaps places with one that leaves (its device row and its host row)."""
        wanted = set(self.counts[:self.in_host].topk(len(self.resident)).indices.tolist())
        leaving = [e for e in self.resident if e not in wanted]
        entering = sorted(wanted - set(self.resident))
        held = moe.stacks()
        for old, new in zip(leaving, entering):
            row, host_row = self.resident.index(old), self.host_row_of.pop(new)
            for name, stack in held.items():
                entering_weights = self.host[name][host_row].clone()
                self.host[name][host_row].copy_(stack[row])  # waits for the device: the pool reads host rows later
                stack[row].copy_(entering_weights)
            self.resident[row], self.host_row_of[old] = new, host_row
            self.row_of[old], self.row_of[new] = -1, row


class ExpertOffload:
    """The experts of every MoE layer of a model, placed as cpu_offload_gb and disk_offload_gb say; what the engine
    asks of a streamer."""

    def __init__(self, moes: list, placement: ExpertPlacement, device: torch.device, revise_every: int | None = None,
                 layer_file: LayerFile | None = None):
        self.placement, self.device, self.layer_file = placement, device, layer_file
        self.pool = ExpertPool(placement.offloaded, moes[0].stacks(), device)
        self.layers = []
        for i, moe in enumerate(moes):
            moe.offload = LayerExperts(moe, placement, self.pool, device, revise_every or REVISE_EVERY, layer_file,
                                       i * placement.num_experts)
            self.layers.append(moe.offload)

    @classmethod
    def for_model(cls, moes: list, config, device: torch.device) -> "ExpertOffload":
        stacks = moes[0].stacks()
        expert_bytes = sum(t[0].numel() * t.element_size() for t in stacks.values())  # blocks where kept quantized
        placement = ExpertPlacement.plan(len(moes), moes[0].num_experts, expert_bytes, int(config.cpu_offload_gb * (1 << 30)),
                                         int(config.disk_offload_gb * (1 << 30)))
        require_host_memory(placement.host * placement.num_layers * expert_bytes,
                            f"cpu_offload_gb={config.cpu_offload_gb:g}")
        layer_file = None
        if placement.disk:
            folder = config.offload_folder or str(cache_dir("offload"))
            require_disk_space(placement.disk * placement.num_layers * expert_bytes, folder,
                               f"disk_offload_gb={config.disk_offload_gb:g}")
            layer_file = LayerFile(folder)
            if device.type == "cuda":
                log_once("experts on disk are read by positional reads through a pinned staging buffer (kvikio "
                         "serves decoder layers, not experts yet)")
        logger.debug(f"experts (cpu_offload_gb={config.cpu_offload_gb:g}, disk_offload_gb={config.disk_offload_gb:g})"
                     f":\n{placement.table(moes[0].top_k)}")
        return cls(moes, placement, device, layer_file=layer_file)

    def module_ids(self) -> set[int]:
        """Modules whose weights change place each step: none (the experts' pool is read by the MoE kernels)."""
        return set()

    def describe(self, device: torch.device) -> str:
        p = self.placement
        disk = f", {p.disk} on disk" if p.disk else ""
        return (f"{p.resident} of {p.num_experts} experts a layer on {device}, {p.host} in host memory{disk} "
                f"(loaded into a pool of {p.offloaded} when routed)")

    @property
    def num_loaded(self) -> int:
        return self.pool.num_loaded
