"""The disk tier: streamed layers' packed weights in one file (written at load into offload_folder, deleted with
the engine), each at an offset aligned for O_DIRECT, and read back by positional reads. O_DIRECT where the file
system takes it, so that a read comes from the disk and not the page cache; buffered reads elsewhere, and the log
says so once. On CUDA with kvikio installed, streaming/kvikio_reader.py reads the same offsets into GPU memory."""
import contextlib
import os
import tempfile
import weakref

import torch

from nanovllm.logger import log_once

DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in whole pages


def aligned(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


class LayerFile:

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="nanovllm-layers-", suffix=".bin", dir=folder)
        os.close(fd)
        weakref.finalize(self, _remove, self.path)
        self.places: dict[int, tuple[int, int]] = {}  # layer -> (offset, bytes)
        self.size = 0
        self.fd = self.direct = None

    def write(self, index: int, buffer: torch.Tensor):
        """A layer's packed weights (uint8, host), appended at the next aligned offset."""
        with open(self.path, "r+b") as f:
            f.seek(self.size)
            f.write(buffer.numpy().tobytes())
            self.places[index] = (self.size, buffer.numel())
            self.size += aligned(buffer.numel())
            f.truncate(self.size)

    def _open(self) -> int:
        if self.fd is None:
            if not os.path.exists(self.path):
                raise FileNotFoundError(f"the streamed weights' file {self.path} is gone (disk_offload_gb keeps layers "
                                        "there while the engine runs): leave offload_folder alone, or start again")
            try:
                self.fd, self.direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT), True
            except (AttributeError, OSError) as error:
                self.fd, self.direct = os.open(self.path, os.O_RDONLY), False
                log_once(f"weights on disk are read through the page cache: O_DIRECT is refused here ({error})")
        return self.fd

    def read_into(self, index: int, out: torch.Tensor):
        """The layer's bytes into the start of out (uint8, host, at least aligned(bytes) long)."""
        offset, nbytes = self.places[index]
        fd, length = self._open(), aligned(nbytes)
        view = memoryview(out.numpy())[:length]
        if self.direct and out.data_ptr() % DIRECT_ALIGN:  # O_DIRECT needs a page-aligned buffer
            staged = torch.empty(length + DIRECT_ALIGN, dtype=torch.uint8)
            start = (-staged.data_ptr()) % DIRECT_ALIGN
            self._read(fd, memoryview(staged.numpy())[start:start + length], offset)
            out[:nbytes].copy_(staged[start:start + nbytes])
            return
        self._read(fd, view, offset)

    def _read(self, fd: int, view: memoryview, offset: int):
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"short read of streamed weights: {done} of {len(view)} bytes at offset {offset} of "
                              f"{self.path}; the file was cut short while the engine ran")
            done += got


def _remove(path: str):
    with contextlib.suppress(FileNotFoundError):  # removed already (by hand, mid-run)
        os.remove(path)
