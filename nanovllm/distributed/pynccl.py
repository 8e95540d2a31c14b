"""NCCL called directly (ctypes) on the current CUDA stream: the collectives of tensor parallelism between GPUs.
torch.distributed's NCCL group keeps per-call host state (work objects, sequence numbers, a watchdog), which costs
host time on every call and does not advance when a captured CUDA graph replays; a bare communicator has neither,
so the same calls run eagerly and inside graphs. The library is the one torch itself loaded (its NCCL wheel)."""
import ctypes
import glob
import os
import threading

import torch

from nanovllm.logger import logger

ABORT_WAIT_S = 10.0
_TYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
          torch.float64: 8, torch.bfloat16: 9}
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def _library() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libnccl.so.2")  # already loaded by torch's CUDA library: dlopen finds it by its soname
    except OSError:
        pass
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))  # where torch's nvidia-nccl wheel lies
    for path in glob.glob(os.path.join(site_packages, "nvidia", "nccl", "lib", "libnccl.so*")):
        return ctypes.CDLL(path)
    raise RuntimeError("libnccl.so.2 not found (torch's nvidia-nccl wheel): tensor parallelism on GPUs needs NCCL")


class NcclCommunicator:
    """One rank's communicator of a group; every call is enqueued on the current stream and returns at once."""

    def __init__(self, rank: int, size: int, unique_id: bytes, device: torch.device):
        self.lib = _library()
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.rank, self.size, self.device = rank, size, device
        self.comm = ctypes.c_void_p()
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, 128)
        with torch.cuda.device(device):
            self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid, rank))

    @staticmethod
    def unique_id() -> bytes:
        """The group's id, made by rank 0 and handed to the others."""
        uid, lib = _UniqueId(), _library()
        if result := lib.ncclGetUniqueId(ctypes.byref(uid)):
            raise RuntimeError(f"ncclGetUniqueId failed with NCCL error {result}")
        return bytes(uid.internal)

    def _check(self, result: int):
        if result:
            raise RuntimeError(f"NCCL error {result}: {self.lib.ncclGetErrorString(result).decode()}")

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place."""
        self._check(self.lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                           ctypes.c_size_t(x.numel()), _TYPES[x.dtype], _OPS[op], self.comm,
                                           self._stream()))
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: rank src's x on every rank."""
        self._check(self.lib.ncclBroadcast(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                           ctypes.c_size_t(x.numel()), _TYPES[x.dtype], src, self.comm,
                                           self._stream()))
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [size * x.numel()]: the ranks' x one after another."""
        self._check(self.lib.ncclAllGather(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                           ctypes.c_size_t(x.numel()), _TYPES[x.dtype], self.comm, self._stream()))
        return out

    def destroy(self):
        """Abort rather than destroy: destroying waits on the peers, which may be gone. The abort still waits until
        every CUDA graph that captured this communicator's calls is freed (workers._release frees them first): bounded,
        so that one left alive costs a warning and the communicator's memory until the process exits, not a hang."""
        if not self.comm:
            return
        comm, self.comm = self.comm, ctypes.c_void_p()
        aborting = threading.Thread(target=self.lib.ncclCommAbort, args=(comm,), daemon=True, name="nanovllm-nccl-abort")
        aborting.start()
        aborting.join(ABORT_WAIT_S)
        if aborting.is_alive():
            logger.warning(f"the NCCL communicator's abort did not end in {ABORT_WAIT_S:.0f} s (a CUDA graph that "
                           "captured its collectives is still alive?): its memory is freed when the process exits")
