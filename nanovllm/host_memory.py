"""Host memory and disk space that offloading asks for, checked before the pinned buffers or the file are made, so
that a setting too large for the machine is an error that names it, not an allocation failure."""
import shutil


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def require_host_memory(nbytes: int, setting: str):
    free = available_bytes()
    if free is not None and nbytes > free:
        raise ValueError(f"{setting} asks for {nbytes / (1 << 30):.2f} GiB of host memory, but {free / (1 << 30):.2f} "
                         "GiB is available: lower it")


def require_disk_space(nbytes: int, folder: str, setting: str):
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise ValueError(f"{setting} asks for {nbytes / (1 << 30):.2f} GiB in {folder}, but {free / (1 << 30):.2f} GiB "
                         "is free there: lower it or choose another offload_folder")
