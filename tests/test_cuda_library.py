"""The build of csrc/'s kernels (nanovllm.kernels.cuda_library): each source compiles for sm_90 and exports its
entry points, where nvcc exists (CPU machines included); without a GPU every kernel is off and says why."""
import pytest
import torch

from nanovllm.kernels import cuda_library

SOURCES = {"gemv_one_row": "nanovllm_gemv_one_row", "paged_decode_cluster": "nanovllm_paged_decode_cluster"}


@pytest.mark.skipif(cuda_library.nvcc() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_source_compiles_for_sm90_and_exports_its_entry_point(name, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    library = cuda_library._build(name, cuda_library.nvcc())
    assert hasattr(library, SOURCES[name]) and library.nanovllm_cuda_error_string(0) == b"no error"
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob(f"{name}_*.so")]


def test_every_source_is_listed():
    assert sorted(p.stem for p in cuda_library.CSRC.glob("*.cu")) == sorted(SOURCES)


def test_off_without_a_gpu_or_when_switched_off(monkeypatch):
    assert cuda_library.why_unavailable("gemv_one_row", torch.device("cpu"), "NANOVLLM_X") == "no CUDA GPU"
    monkeypatch.setenv("NANOVLLM_X", "0")
    assert cuda_library.why_unavailable("gemv_one_row", torch.device("cuda"), "NANOVLLM_X") == "NANOVLLM_X=0"
