"""Decoder layers whose weights live in host memory (pinned on CUDA) or on disk (streaming/layer_file.py) and are
copied into a few device slots just before they run. Each streamed layer's parameters are packed into one buffer,
kept in host memory or written to the disk file (read back through a pinned staging buffer a slot). Before the
layer's forward its parameters are pointed at the slot that holds its copy (the model code does not know). While a
layer computes, the next streamed layers load into the other slots on a transfer stream ("loaded" events gate the
compute, "consumed" events gate the overwrite); a layer still in a slot from before is not copied again, and the
slot given up is the one whose layer runs furthest ahead in the cyclic layer order. On CPU the slots are host
tensors and the copies plain: the same bookkeeping, tested in CI. Steps run eagerly (hooks, not captured in CUDA
graphs). Disk reads go by kvikio straight into a slot where it is installed (streaming/kvikio_reader.py), waited
for when the layer runs; else a positional read blocks the host while the device computes the layers launched."""
import weakref

import torch
from torch import nn

from nanovllm.cache_dir import cache_dir
from nanovllm.host_memory import require_disk_space, require_host_memory
from nanovllm.logger import log_once, logger
from nanovllm.streaming.kvikio_reader import PendingRead, open_kvikio
from nanovllm.streaming.layer_file import LayerFile, aligned
from nanovllm.streaming.placement import plan_placement

ALIGN = 256  # bytes: each parameter's offset in a buffer, for the kernels' vectorized loads


class LayerStreamer:

    def __init__(self, layers: list[nn.Module], streamed: list[int], device: torch.device, num_slots: int = 2,
                 disk: list[int] = (), layer_file: LayerFile | None = None):
        """streamed: the layers that stream, in the order they run; disk: those of them read from layer_file."""
        self.layers, self.streamed, self.device = layers, list(streamed), device
        self.cuda = device.type == "cuda"
        self.disk, self.layer_file = set(disk), layer_file
        self.shared = shared_module_ids(layers)
        self.entries: dict[int, list[tuple]] = {}  # layer -> (holder, key, byte offset, shape, dtype) a tensor
        self.host: dict[int, torch.Tensor] = {}
        self.sizes: dict[int, int] = {}
        for index in self.streamed:
            self._pack(index)
        size = aligned(max(self.sizes.values()))  # whole pages: a disk read lands in a slot whole
        self.num_slots = min(num_slots, len(self.streamed))
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.num_slots)]
        self.kvikio = open_kvikio(layer_file.path) if self.cuda and self.disk else None
        if self.disk and not self.cuda:
            log_once("weights on disk are read by plain positional reads into host slots (CPU)")
        self.reads: dict[int, PendingRead] = {}  # slot -> its kvikio read under way
        self.staging = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(self.num_slots)] \
            if self.cuda and self.disk and self.kvikio is None else None
        self.slot_layer: list[int | None] = [None] * self.num_slots
        self.slot_of: dict[int, int] = {}
        self.num_loads = 0  # statistics: layer copies into a slot
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.loaded = [torch.cuda.Event() for _ in range(self.num_slots)]
            self.consumed = [torch.cuda.Event() for _ in range(self.num_slots)]
        for index in self.streamed:
            # through a weak reference: a hook that held the streamer, which holds the layers, would keep the model
            # alive after the engine is given up, until the garbage collector found the cycle
            streamer = weakref.ref(self)
            layers[index].register_forward_pre_hook(lambda module, args, i=index: streamer()._before(i))
            layers[index].register_forward_hook(lambda module, args, out, i=index: streamer()._after(i))

    @classmethod
    def for_layers(cls, layers: list[nn.Module], device: torch.device, cpu_offload_gb: float, disk_offload_gb: float,
                   offload_folder: str | None) -> "LayerStreamer":
        """The placement plan for these decoder layers (logged as a table), and their streamer."""
        placement = plan_placement(streamed_bytes(layers), int(cpu_offload_gb * (1 << 30)), int(disk_offload_gb * (1 << 30)))
        require_host_memory(placement.bytes_of(placement.host), f"cpu_offload_gb={cpu_offload_gb:g}")
        folder = offload_folder or str(cache_dir("offload"))
        layer_file = LayerFile(folder) if placement.disk else None
        if layer_file is not None:
            require_disk_space(placement.bytes_of(placement.disk), folder, f"disk_offload_gb={disk_offload_gb:g}")
        where = f"; on disk in {layer_file.path}" if layer_file else ""
        logger.debug(f"weights (cpu_offload_gb={cpu_offload_gb:g}, disk_offload_gb={disk_offload_gb:g}{where}):\n"
                    f"{placement.table()}")
        return cls(layers, placement.streamed, device, disk=placement.disk, layer_file=layer_file)

    def describe(self, device: torch.device) -> str:
        disk = f", {len(self.disk)} of them from disk" if self.disk else ""
        return (f"{len(self.streamed)} of {len(self.layers)} decoder layers streamed in from host memory{disk}, "
                f"{self.num_slots} slots on {device}")

    def module_ids(self) -> set[int]:
        """id() of every module of the streamed layers."""
        return {id(m) for i in self.streamed for m in self.layers[i].modules()}

    def _pack(self, index: int):
        """The layer's tensors copied into one host buffer; each left empty until bound to a slot."""
        tensors, entries, at = list(streamed_tensors(self.layers[index], self.shared)), [], 0
        for holder, key, t in tensors:
            entries.append((holder, key, at, t.shape, t.dtype))
            at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        on_disk = index in self.disk
        buffer = torch.empty(at, dtype=torch.uint8, pin_memory=self.cuda and not on_disk)
        for (holder, key, t), (_, _, offset, _, dtype) in zip(tensors, entries):
            buffer[offset:offset + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
            _bind(holder, key, torch.empty(0, dtype=dtype, device=self.device))
        if on_disk:
            self.layer_file.write(index, buffer)
        else:
            self.host[index] = buffer
        self.entries[index], self.sizes[index] = entries, at

    def _upcoming(self, index: int, count: int) -> list[int]:
        """The next `count` streamed layers after `index`, wrapping to the next step."""
        at = self.streamed.index(index)
        return [self.streamed[(at + k) % len(self.streamed)] for k in range(1, count + 1)]

    def _victim(self, index: int, keep: set[int]) -> int:
        """A slot to load into: an empty one, else the one whose layer runs furthest after `index` (which itself
        runs again last)."""
        order = {layer: k for k, layer in enumerate([*self._upcoming(index, len(self.streamed) - 1), index])}
        candidates = [s for s in range(self.num_slots) if s not in keep]
        return max(candidates, key=lambda s: len(order) if self.slot_layer[s] is None else order[self.slot_layer[s]])

    def _load(self, index: int, slot: int):
        old = self.slot_layer[slot]
        if old is not None:
            del self.slot_of[old]
        self.slot_layer[slot], self.slot_of[index] = index, slot
        self.num_loads += 1
        if index in self.disk and not self.cuda:
            self.layer_file.read_into(index, self.slots[slot])
            return
        if index in self.disk and self.kvikio is not None:  # straight into the slot, once its last layer is done
            self.consumed[slot].synchronize()
            offset, nbytes = self.layer_file.places[index]
            self.reads[slot] = self.kvikio.read(offset, aligned(nbytes), self.slots[slot])
            return
        if index in self.disk:  # staged: the slot's last copy out of its staging buffer must be done first
            self.loaded[slot].synchronize()
            self.layer_file.read_into(index, self.staging[slot])
            source = self.staging[slot][:self.sizes[index]]
        else:
            source = self.host[index]
        target = self.slots[slot][:source.numel()]
        if not self.cuda:
            target.copy_(source)
            return
        self.stream.wait_event(self.consumed[slot])
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            self.loaded[slot].record(self.stream)

    def _before(self, index: int):
        if index not in self.slot_of:
            self._load(index, self._victim(index, set()))
        slot = self.slot_of[index]
        if slot in self.reads:
            self.reads.pop(slot).wait()
        elif self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[slot])
        buffer = self.slots[slot]
        for holder, key, offset, shape, dtype in self.entries[index]:
            nbytes = shape.numel() * dtype.itemsize
            _bind(holder, key, buffer[offset:offset + nbytes].view(dtype).view(shape))

    def _after(self, index: int):
        """With the layer's work launched: its slot may be reused once that work is done; the next layers load."""
        if self.cuda:
            self.consumed[self.slot_of[index]].record(torch.cuda.current_stream(self.device))
        keep: set[int] = set()
        for upcoming in self._upcoming(index, self.num_slots):
            if upcoming not in self.slot_of:
                self._load(upcoming, self._victim(index, keep))
            keep.add(self.slot_of[upcoming])


def shared_module_ids(layers: list[nn.Module]) -> set[int]:
    """Modules that occur in more than one layer (a rotary table): their tensors stay where they are."""
    seen, shared = set(), set()
    for layer in layers:
        ids = {id(m) for m in layer.modules()}
        shared |= seen & ids
        seen |= ids
    return shared


def streamed_bytes(layers: list[nn.Module]) -> list[int]:
    """The bytes each layer would stream (quantized layers: their quantized blocks)."""
    shared = shared_module_ids(layers)
    return [sum(t.numel() * t.element_size() for _, _, t in streamed_tensors(layer, shared)) for layer in layers]


def streamed_tensors(layer: nn.Module, shared: set[int]):
    """(holder, key, tensor) of each tensor the layer's forward reads that is its own: parameters (the holder is
    the Parameter, its .data rebound), buffers (holder: the module's buffer dict) and GGUF / int4 fields (holder:
    the weight's field dict, quant/gguf_weight.py)."""
    seen = set()
    for module in layer.modules():
        if id(module) in shared:
            continue
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield p, None, p.data
        for name, buffer in module._buffers.items():
            if buffer is not None:
                yield module._buffers, name, buffer
        for _, weight in getattr(module, "qweights", []):
            for name, field in weight.fields.items():
                yield weight.fields, name, field


def _bind(holder, key, tensor: torch.Tensor):
    if key is None:
        holder.data = tensor
    else:
        holder[key] = tensor
