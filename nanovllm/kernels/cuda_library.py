"""The CUDA C++ kernels of csrc/: each .cu is built by nvcc at first use into a cache folder (NANOVLLM_CACHE,
default ~/.cache/nanovllm), keyed by the hash of its source, csrc/common.cuh and the flags, and loaded with ctypes
(no torch headers: a build takes seconds). CUDA graphs capture their launches like any other. Hopper and newer."""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanovllm.cache_dir import cache_dir
from nanovllm.kernels import pdl
from nanovllm.logger import log_once

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC_FLAGS = ["-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90"]

_libraries: dict[str, ctypes.CDLL] = {}
_entry_reasons: dict[tuple[str, str], str | None] = {}


def nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(candidate) if candidate.exists() else None)


def _build(name: str, compiler: str) -> ctypes.CDLL:
    """Compile csrc/<name>.cu once per content and flags (the file name holds their hash), then load it."""
    source = CSRC / f"{name}.cu"
    digest = hashlib.sha256(source.read_bytes() + (CSRC / "common.cuh").read_bytes()
                            + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    cache = cache_dir()
    target = cache / f"{name}_{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: concurrent builds are safe
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *NVCC_FLAGS, "-o", str(built), str(source)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise RuntimeError(f"nvcc failed on {source.name}: {done.stderr.strip()[-500:]}")
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    library.nanovllm_cuda_error_string.restype = ctypes.c_char_p
    library.nanovllm_cuda_error_string.argtypes = [ctypes.c_int]
    return library


def why_unavailable(name: str, device: torch.device, switch: str, hopper: bool = True) -> str | None:
    """None when csrc/<name>.cu is built (now, if it was not) and can run on `device`, else why not. switch: the
    environment variable that turns the kernel off when 0; hopper: whether it needs sm_90 (host-only code does not)."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    if device.type != "cuda":
        return "no CUDA GPU"
    if hopper and (reason := pdl.not_hopper(device)) is not None:
        return reason
    if not (CSRC / f"{name}.cu").exists():
        return f"{CSRC / name}.cu is missing"
    if name not in _libraries:
        compiler = nvcc()
        if compiler is None:
            return "nvcc not found: put it on PATH or set CUDA_HOME"
        try:
            _libraries[name] = _build(name, compiler)
        except (RuntimeError, OSError) as error:
            return str(error)
    return None


def entry_point(name: str, device: torch.device, switch: str, argtypes: list, on: str | None = None,
                off: str | None = None, hopper: bool = True) -> str | None:
    """why_unavailable(), once per kernel and device; where the kernel runs, its entry point nanovllm_<name> is typed
    (returns a cudaError_t; argtypes). On CUDA the path is logged once when given: `on`, or `off` with {reason}."""
    key = (name, str(device))
    if key not in _entry_reasons:
        _entry_reasons[key] = reason = why_unavailable(name, device, switch, hopper)
        if reason is None:
            entry = getattr(_libraries[name], f"nanovllm_{name}")
            entry.restype, entry.argtypes = ctypes.c_int, argtypes
        message = on if reason is None else off.format(reason=reason) if off is not None else None
        if device.type == "cuda" and message is not None:
            log_once(message)
    return _entry_reasons[key]


def library(name: str) -> ctypes.CDLL:
    """The loaded library of csrc/<name>.cu (after why_unavailable said None)."""
    return _libraries[name]


def check(library: ctypes.CDLL, error: int, what: str):
    if error != 0:
        raise RuntimeError(f"{what} launch failed: {library.nanovllm_cuda_error_string(error).decode()}")


def stream_of(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream


def pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
