"""The all-reduce of small tensors between the GPUs of one host: the one-shot kernel (kernels/all_reduce.py) over
buffers every rank can read. Each rank allocates a buffer and flags; the ranks trade their CUDA IPC handles over
gloo and open the others' on their own GPU (the driver's cuIpcOpenMemHandle with peer access enabled: torch's own
IPC opens a handle on the GPU that owns it, a context that the local GPU's kernels cannot reach through). Tensors
past max_bytes (prefill steps, large batches) and other dtypes go to NCCL. max_bytes is measured when the group
starts (measure_max_bytes): the largest size up to which the kernel beats NCCL on these GPUs and their link. Its
first version lost to NCCL past 512 KB on two H100s (36.2 against 24.6 us at 1 MB, docs/benchmarks.md)."""
import ctypes

import torch

from nanovllm.kernels.all_reduce import MAX_PROGRAMS, one_shot_all_reduce
from nanovllm.logger import log_once

BUFFER_BYTES = 4 << 20  # a buffer slot: the largest tensor the kernel can take
CANDIDATE_BYTES = (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20)  # where it is timed against NCCL
FLOOR_BYTES = 128 << 10  # taken by the kernel whatever the timings: latency, not bandwidth, rules below
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def why_not_custom(size: int) -> str | None:
    """Why the group's GPUs cannot read each other's memory (None: they can)."""
    peers = [(a, b) for a in range(size) for b in range(size) if a != b and not torch.cuda.can_device_access_peer(a, b)]
    return f"GPUs {peers[0]} cannot access each other's memory (no P2P)" if peers else None


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * 64)]


class _PeerMemory:
    """CUDA IPC through the driver API: handles of this process's allocations, and the peers' allocations mapped
    into this process on the current GPU."""

    def __init__(self):
        self.driver = ctypes.CDLL("libcuda.so.1")
        self.opened: list[int] = []

    def _check(self, result: int, call: str):
        if result:
            raise RuntimeError(f"{call} failed with CUDA driver error {result}")

    def handle(self, t: torch.Tensor) -> tuple[bytes, int]:
        """The IPC handle of t's allocation, and t's offset in it."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self.driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                        ctypes.c_uint64(t.data_ptr())), "cuMemGetAddressRange")
        handle = _IpcHandle()
        self._check(self.driver.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        return bytes(handle.reserved), t.data_ptr() - base.value

    def open(self, handle: bytes, offset: int) -> int:
        """The address in this process of a peer's tensor, from its handle and offset."""
        raw = _IpcHandle()
        ctypes.memmove(raw.reserved, handle, 64)
        base = ctypes.c_uint64()
        self._check(self.driver.cuIpcOpenMemHandle_v2(ctypes.byref(base), raw, 1), "cuIpcOpenMemHandle")  # 1: lazy P2P
        self.opened.append(base.value)
        return base.value + offset

    def close(self):
        for base in self.opened:
            self.driver.cuIpcCloseMemHandle(ctypes.c_uint64(base))
        self.opened = []


class CustomAllReduce:
    def __init__(self, rank: int, size: int, device: torch.device, all_gather_object):
        """all_gather_object(obj) -> every rank's obj, in rank order (over gloo)."""
        self.rank = rank
        # the two buffer slots, then the flags: one allocation, one IPC handle
        self.memory = torch.zeros(2 * BUFFER_BYTES + size * MAX_PROGRAMS * 4, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        self.peers = _PeerMemory()
        shared = all_gather_object(self.peers.handle(self.memory))
        data = [self.memory.data_ptr() if r == rank else self.peers.open(*handle) for r, handle in enumerate(shared)]
        self.data_ptrs = torch.tensor(data, dtype=torch.int64, device=device)
        self.flag_ptrs = self.data_ptrs + 2 * BUFFER_BYTES
        self.epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        self.max_bytes = BUFFER_BYTES  # until measure_max_bytes
        all_gather_object(None)  # every rank has opened the others' memory before any kernel writes to it

    def close(self):
        self.peers.close()

    def can_run(self, x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        return one_shot_all_reduce(x, self.data_ptrs, self.flag_ptrs, self.epochs, self.rank,
                                   BUFFER_BYTES // x.element_size())


def measure_max_bytes(custom: CustomAllReduce, nccl_all_reduce, all_gather_object) -> int:
    """Time the kernel and NCCL on bf16 tensors of CANDIDATE_BYTES (every rank the same calls, in the same order),
    take each size's slowest rank, set custom.max_bytes to choose_max_bytes' pick, log the table once, return it."""
    timings = []
    for nbytes in CANDIDATE_BYTES:
        x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=custom.memory.device)
        timings.append((_microseconds(custom, x), _microseconds(nccl_all_reduce, x)))
    ranks = all_gather_object(timings)
    slowest = [tuple(max(rank[i][j] for rank in ranks) for j in range(2)) for i in range(len(CANDIDATE_BYTES))]
    custom.max_bytes = choose_max_bytes(CANDIDATE_BYTES, slowest)
    log_once("one-shot all-reduce against NCCL, us: " + ", ".join(
        f"{n >> 10} KiB {a:.1f} / {b:.1f}" for n, (a, b) in zip(CANDIDATE_BYTES, slowest)))
    return custom.max_bytes


def choose_max_bytes(sizes, timings) -> int:
    """The largest size up to which the kernel beat NCCL at every timed size (timings: (kernel, NCCL) a size), at
    least FLOOR_BYTES."""
    chosen = FLOOR_BYTES
    for nbytes, (kernel, nccl) in zip(sizes, timings):
        if kernel >= nccl:
            break
        chosen = nbytes
    return chosen


def _microseconds(all_reduce, x: torch.Tensor, calls: int = 20) -> float:
    for _ in range(3):
        all_reduce(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        all_reduce(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls
