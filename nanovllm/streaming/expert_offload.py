"""Experts past the GPU. With cpu_offload_gb on a mixture-of-experts model the unit of placement is the expert: the
layers' dense parts (attention, norms, router, shared expert) and the embeddings stay resident, and in each MoE layer
as many experts as the budget leaves stay on the device while the rest live in host memory (pinned on CUDA). A step
runs a layer's router, its resident experts on the pairs routed to them, then loads the union of the batch's routed
non-resident experts into a device pool shared by the layers (one gathered copy each of gate_up and down) and runs
them on theirs. Which experts are resident follows the routing counts seen so far, revised every `revise_every`
forwards of a layer. Steps run eagerly: the routed experts are read on the host. On CPU the same bookkeeping, with
host tensors as the "device", tested in CI."""
import math
from dataclasses import dataclass

import torch

from nanovllm.logger import logger

REVISE_EVERY = 64  # forwards of a layer between two revisions of its resident experts


@dataclass(frozen=True)
class ExpertPlacement:
    num_layers: int  # MoE layers
    num_experts: int  # a layer
    expert_bytes: int
    resident: int  # experts a layer kept on the device

    @classmethod
    def plan(cls, num_layers: int, num_experts: int, expert_bytes: int, offload_bytes: int) -> "ExpertPlacement":
        """The fewest experts a layer, the same in every layer, that hold offload_bytes in host memory."""
        per_layer = min(num_experts, math.ceil(offload_bytes / max(1, expert_bytes * num_layers)))
        return cls(num_layers, num_experts, expert_bytes, num_experts - per_layer)

    @property
    def offloaded(self) -> int:
        return self.num_experts - self.resident

    def table(self) -> str:
        gib = self.expert_bytes * self.num_layers / (1 << 30)
        return ("| experts in | a layer | all layers |\n|---|---|---|\n"
                f"| device | {self.resident} | {self.resident * gib:.2f} GiB |\n"
                f"| host memory | {self.offloaded} | {self.offloaded * gib:.2f} GiB |")


class ExpertPool:
    """Device rows that a layer's routed non-resident experts are copied into, shared by the layers (they run one
    after another), with the pinned staging buffers that gather them on the host."""

    def __init__(self, rows: int, w13_shape, w2_shape, dtype: torch.dtype, device: torch.device):
        self.cuda = device.type == "cuda"
        self.w13 = torch.empty(rows, *w13_shape, dtype=dtype, device=device)
        self.w2 = torch.empty(rows, *w2_shape, dtype=dtype, device=device)
        self.stage13 = torch.empty(rows, *w13_shape, dtype=dtype, pin_memory=self.cuda) if self.cuda else None
        self.stage2 = torch.empty(rows, *w2_shape, dtype=dtype, pin_memory=self.cuda) if self.cuda else None
        self.copied = torch.cuda.Event() if self.cuda else None
        self.num_loaded = 0  # statistics: experts copied in

    def load(self, host13: torch.Tensor, host2: torch.Tensor, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """These experts' weights in the pool's first rows."""
        n, index = len(experts), torch.tensor(experts)
        self.num_loaded += n
        if not self.cuda:
            torch.index_select(host13, 0, index, out=self.w13[:n])
            torch.index_select(host2, 0, index, out=self.w2[:n])
            return self.w13[:n], self.w2[:n]
        self.copied.synchronize()  # the staging rows of the layer before have reached the device
        torch.index_select(host13, 0, index, out=self.stage13[:n])
        torch.index_select(host2, 0, index, out=self.stage2[:n])
        self.w13[:n].copy_(self.stage13[:n], non_blocking=True)
        self.w2[:n].copy_(self.stage2[:n], non_blocking=True)
        self.copied.record()
        return self.w13[:n], self.w2[:n]


class LayerExperts:
    """One MoE layer's experts: all of them in host memory, the resident ones also in its FusedMoE's w13 / w2."""

    def __init__(self, moe, resident: int, pool: ExpertPool, device: torch.device, revise_every: int):
        self.pool, self.revise_every = pool, revise_every
        pin = device.type == "cuda"
        self.host13 = moe.w13.data.pin_memory() if pin else moe.w13.data
        self.host2 = moe.w2.data.pin_memory() if pin else moe.w2.data
        num_experts = self.host13.shape[0]
        self.resident = list(range(resident))
        moe.w13 = torch.nn.Parameter(self.host13[:resident].to(device, copy=True), requires_grad=False)
        moe.w2 = torch.nn.Parameter(self.host2[:resident].to(device, copy=True), requires_grad=False)
        self.row_of = torch.full((num_experts,), -1, dtype=torch.int64, device=device)  # resident expert -> its row
        self.row_of[:resident] = torch.arange(resident, device=device)
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)  # routed pairs seen, an expert
        self.forwards = 0

    def run(self, moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = self.row_of[ids]
        out = moe.experts(x, moe.w13, moe.w2, weights, rows, leaves_out=True) if self.resident else \
            torch.zeros_like(x)
        needed = ids[rows < 0].unique()
        if needed.numel():
            w13, w2 = self.pool.load(self.host13, self.host2, needed.tolist())
            pool_row = torch.full_like(self.row_of, -1)
            pool_row[needed] = torch.arange(needed.numel(), device=ids.device)
            out = out + moe.experts(x, w13, w2, weights, pool_row[ids], leaves_out=True)
        self.counts.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        self.forwards += 1
        if self.resident and self.forwards % self.revise_every == 0:
            self.revise(moe)
        return out

    def revise(self, moe):
        """The most routed experts so far become the resident ones: each that enters takes the row of one that
        leaves."""
        wanted = set(self.counts.topk(len(self.resident)).indices.tolist())
        leaving = [e for e in self.resident if e not in wanted]
        entering = sorted(wanted - set(self.resident))
        for old, new in zip(leaving, entering):
            row = self.resident.index(old)
            moe.w13.data[row].copy_(self.host13[new], non_blocking=True)
            moe.w2.data[row].copy_(self.host2[new], non_blocking=True)
            self.resident[row] = new
            self.row_of[old], self.row_of[new] = -1, row


class ExpertOffload:
    """The experts of every MoE layer of a model, placed as cpu_offload_gb says; what the engine asks of a streamer."""

    def __init__(self, moes: list, placement: ExpertPlacement, device: torch.device, revise_every: int | None = None):
        self.placement, self.device = placement, device
        revise_every = revise_every or REVISE_EVERY
        w13, w2 = moes[0].w13, moes[0].w2
        self.pool = ExpertPool(placement.offloaded, w13.shape[1:], w2.shape[1:], w13.dtype, device)
        self.layers = []
        for moe in moes:
            moe.offload = LayerExperts(moe, placement.resident, self.pool, device, revise_every)
            self.layers.append(moe.offload)

    @classmethod
    def for_model(cls, moes: list, config, device: torch.device) -> "ExpertOffload":
        if moes[0].quantized is not None:
            raise NotImplementedError("cpu_offload_gb does not stream experts kept quantized yet (quantization='gguf' "
                                      "on CPU): every weight is in host memory already")
        if config.disk_offload_gb:
            raise NotImplementedError("disk_offload_gb is not supported yet for mixture-of-experts models: their "
                                      "experts stream from host memory (cpu_offload_gb)")
        w13, w2 = moes[0].w13, moes[0].w2
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        placement = ExpertPlacement.plan(len(moes), w13.shape[0], expert_bytes, int(config.cpu_offload_gb * (1 << 30)))
        logger.debug(f"experts (cpu_offload_gb={config.cpu_offload_gb:g}):\n{placement.table()}")
        return cls(moes, placement, device)

    def module_ids(self) -> set[int]:
        """Modules whose weights change place each step: none (the experts' pool is read by the MoE kernels)."""
        return set()

    def describe(self, device: torch.device) -> str:
        p = self.placement
        return (f"{p.resident} of {p.num_experts} experts a layer on {device}, {p.offloaded} in host memory "
                f"(loaded into a pool of {p.offloaded} when routed)")

    @property
    def num_loaded(self) -> int:
        return self.pool.num_loaded
