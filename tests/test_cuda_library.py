"""The build of csrc/'s kernels (nanovllm.kernels.cuda_library): each source compiles for sm_90 and exports its
entry points, where nvcc exists (CPU machines included); without a GPU every kernel is off and says why."""
import ctypes

import pytest
import torch

from nanovllm.kernels import cuda_library

SOURCES = {"gemv_one_row": "nanovllm_gemv_one_row", "gguf_gemv_one_row": "nanovllm_gguf_gemv_one_row",
           "paged_decode_cluster": "nanovllm_paged_decode_cluster", "sgdma": "nanovllm_sgdma"}


@pytest.mark.skipif(cuda_library.nvcc() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_source_compiles_for_sm90_and_exports_its_entry_point(name, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    library = cuda_library._build(name, cuda_library.nvcc())
    assert hasattr(library, SOURCES[name]) and library.nanovllm_cuda_error_string(0) == b"no error"
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob(f"{name}_*.so")]


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


def test_kernel_phases_script_finds_its_anchors(monkeypatch):
    """scripts/kernel_phases.py stamps the kernels at lines of their source: an edit that moves one must update
    the script (stamped() asserts that each anchor occurs once)."""
    monkeypatch.syspath_prepend(str(cuda_library.CSRC.parent / "scripts"))
    import kernel_phases

    for name, stamps in (("gemv_one_row", kernel_phases.GEMV_STAMPS),
                         ("paged_decode_cluster", kernel_phases.ATTENTION_STAMPS)):
        assert kernel_phases.stamped(name, stamps).count("STAMP(") == len(stamps) + 1  # and the macro


def test_kernel_phases_keeps_the_first_decode_step_only(monkeypatch):
    """The engine may run the next step before the records are read: the timeline keeps the CTAs that start before
    the second step's first qkv GEMV (layer 0), and all of them when there is one step."""
    monkeypatch.syspath_prepend(str(cuda_library.CSRC.parent / "scripts"))
    import kernel_phases

    def record(pointer, start):
        return [kernel_phases.GEMV, pointer, 0, 0, start] + [0] * 27

    owners = {1: (0, "qkv"), 2: (0, "o")}
    one_step = [record(1, 0), record(1, 2_000), record(2, 5_000)]
    two_steps = one_step + [record(1, 800_000), record(1, 801_000), record(2, 805_000)]
    assert kernel_phases.first_step(two_steps, owners) == one_step
    assert kernel_phases.first_step(one_step, owners) == one_step
