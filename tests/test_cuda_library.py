"""The build of csrc/'s kernels (nanovllm.kernels.cuda_library): each source compiles for sm_90 and exports its
entry points, where nvcc exists (CPU machines included); without a GPU every kernel is off and says why."""
import ctypes

import pytest
import torch

from nanovllm.kernels import cuda_library

SOURCES = {"gemv_one_row": "nanovllm_gemv_one_row", "gguf_gemv_one_row": "nanovllm_gguf_gemv_one_row",
           "paged_decode_cluster": "nanovllm_paged_decode_cluster", "sgdma": "nanovllm_sgdma"}


@pytest.mark.slow
@pytest.mark.skipif(cuda_library.nvcc() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_source_compiles_for_sm90_and_exports_its_entry_point(name, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    library = cuda_library._build(name, cuda_library.nvcc())
    assert hasattr(library, SOURCES[name]) and library.nanovllm_cuda_error_string(0) == b"no error"
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob(f"{name}_*.so")]


@pytest.mark.slow
@pytest.mark.skipif(cuda_library.nvcc() is None, reason="no nvcc on this machine")
def test_entry_point_builds_types_and_logs_once(tmp_path, monkeypatch):
    """Where a kernel can run (here: pretended), its entry point is typed once per device and the path logged once."""
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda_library.pdl, "not_hopper", lambda device: None)
    monkeypatch.setattr(cuda_library, "_libraries", {})
    monkeypatch.setattr(cuda_library, "_entry_reasons", {})
    said = []
    monkeypatch.setattr(cuda_library, "log_once", said.append)
    argtypes = [ctypes.c_int, ctypes.c_void_p]
    for _ in range(2):
        assert cuda_library.entry_point("gemv_one_row", torch.device("cuda", 7), "NANOVLLM_X", argtypes, "on") is None
    entry = cuda_library.library("gemv_one_row").nanovllm_gemv_one_row
    assert entry.restype is ctypes.c_int and entry.argtypes == argtypes and said == ["on"]
    monkeypatch.setenv("NANOVLLM_Y", "0")
    assert cuda_library.entry_point("gemv_one_row", torch.device("cuda", 6), "NANOVLLM_Y", argtypes, "on",
                                    "off ({reason})") == "NANOVLLM_Y=0"
    assert said == ["on", "off (NANOVLLM_Y=0)"]


def test_every_source_is_listed():
    assert sorted(p.stem for p in cuda_library.CSRC.glob("*.cu")) == sorted(SOURCES)


def test_off_without_a_gpu_or_when_switched_off(monkeypatch):
    assert cuda_library.why_unavailable("gemv_one_row", torch.device("cpu"), "NANOVLLM_X") == "no CUDA GPU"
    monkeypatch.setenv("NANOVLLM_X", "0")
    assert cuda_library.why_unavailable("gemv_one_row", torch.device("cuda"), "NANOVLLM_X") == "NANOVLLM_X=0"

