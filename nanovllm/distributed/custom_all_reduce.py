"""The all-reduce of small tensors between the GPUs of one host: the one-shot kernel (kernels/all_reduce.py) over
buffers every rank can read. Each rank allocates a buffer and flags; the ranks trade their CUDA IPC handles over
gloo and open the others' on their own GPU (the driver's cuIpcOpenMemHandle with peer access enabled: torch's own
IPC opens a handle on the GPU that owns it, a context that the local GPU's kernels cannot reach through). Tensors
past MAX_BYTES (prefill steps, large batches) and other dtypes go to NCCL."""
import ctypes

import torch

from nanovllm.kernels.all_reduce import MAX_PROGRAMS, one_shot_all_reduce

# the largest tensor the one-shot kernel takes: on two H100s it took 6.6 / 9.1 / 21.4 / 36.2 us for 8 / 128 / 512 /
# 1024 KB against NCCL's 16.8 / 17.1 / 20.2 / 24.6 us (docs/benchmarks.md)
MAX_BYTES = 512 << 10
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
        self.memory = torch.zeros(2 * MAX_BYTES + size * MAX_PROGRAMS * 4, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        self.peers = _PeerMemory()
        shared = all_gather_object(self.peers.handle(self.memory))
        data = [self.memory.data_ptr() if r == rank else self.peers.open(*handle) for r, handle in enumerate(shared)]
        self.data_ptrs = torch.tensor(data, dtype=torch.int64, device=device)
        self.flag_ptrs = self.data_ptrs + 2 * MAX_BYTES
        self.epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        all_gather_object(None)  # every rank has opened the others' memory before any kernel writes to it

    def close(self):
        self.peers.close()

    def can_run(self, x: torch.Tensor) -> bool:
        return x.dtype in _DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= MAX_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        return one_shot_all_reduce(x, self.data_ptrs, self.flag_ptrs, self.epochs, self.rank,
                                   MAX_BYTES // x.element_size())
