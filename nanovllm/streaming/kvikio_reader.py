"""Streamed layers read from disk straight into GPU memory by kvikio: through GPUDirect Storage where the system has
it, else in kvikio's compatibility mode (POSIX reads into its pinned bounce buffers, O_DIRECT where aligned, then a
copy to the GPU). Where kvikio is not installed (an optional package: kvikio-cu12 / kvikio-cu13) or
NANOVLLM_KVIKIO=0, open_kvikio() gives None and the layer file's own positional reads run, which the log says."""
import os

import torch

from nanovllm.logger import log_once


class KvikioReader:

    def __init__(self, path: str):
        import kvikio
        import kvikio.defaults

        kvikio.defaults.set("auto_direct_io_read", True)  # compatibility mode too reads past the page cache
        self.path, self.file = path, kvikio.CuFile(path, "r")
        self.gds = not kvikio.defaults.is_compat_mode_preferred()
        log_once("weights on disk are read into GPU memory by kvikio " + (
            "through GPUDirect Storage" if self.gds else "in compatibility mode (no GPUDirect Storage here: POSIX reads "
            "into pinned bounce buffers, then a copy)"))

    def read(self, offset: int, nbytes: int, out: torch.Tensor) -> "PendingRead":
        """Start reading nbytes at offset into the start of out (uint8, on the GPU)."""
        return PendingRead(self.file.pread(out, nbytes, offset), nbytes, offset, self.path)


class PendingRead:

    def __init__(self, future, nbytes: int, offset: int, path: str):
        self.future, self.nbytes, self.offset, self.path = future, nbytes, offset, path

    def wait(self):
        try:
            got = self.future.get()
        except RuntimeError as error:  # kvikio's POSIX errors, a read past the end ("EOF") among them
            raise OSError(f"reading streamed weights from {self.path} by kvikio failed at offset {self.offset} "
                          f"({error}); the file was cut short or damaged while the engine ran") from error
        if got != self.nbytes:
            raise OSError(f"short read of streamed weights from {self.path} by kvikio: {got} of {self.nbytes} bytes "
                          f"at offset {self.offset}; the file was cut short while the engine ran")


def open_kvikio(path: str) -> KvikioReader | None:
    if os.environ.get("NANOVLLM_KVIKIO") == "0":
        log_once("NANOVLLM_KVIKIO=0: weights on disk are read by plain positional reads, not kvikio")
        return None
    try:
        return KvikioReader(path)
    except ImportError:
        log_once("kvikio is not installed: weights on disk are read by plain positional reads through a pinned "
                 "staging buffer (pip install kvikio-cu13 reads them into GPU memory)")
        return None
