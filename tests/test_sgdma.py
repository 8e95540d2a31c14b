"""sgDMA (comm/sgdma.py): whole KV blocks between two block caches. Its torch twin against plain per-block
assignment on CPU; on CUDA the cudaMemcpy2DAsync path against the twin byte for byte, both directions, scattered
blocks and runs of consecutive ones."""
import pytest
import torch

from nanovllm.comm import sgdma

SHAPE = (2, 3, None, 4, 2, 8)  # [K/V, layers, blocks, block_size, kv_heads, head_dim]
CASES = [([0, 5, 2], [7, 1, 3]), ([1, 2, 3, 4], [4, 5, 6, 7]), ([6, 7, 0, 9], [2, 3, 8, 0])]  # scattered, runs


def cache(blocks: int, device="cpu", seed: int = 0, pin: bool = False) -> torch.Tensor:
    shape = tuple(blocks if s is None else s for s in SHAPE)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return values.pin_memory() if pin else values.to(device)


def per_block(src, dst, src_blocks, dst_blocks) -> torch.Tensor:
    want = dst.clone()
    for s, d in zip(src_blocks, dst_blocks):
        want[:, :, d] = src[:, :, s]
    return want


@pytest.mark.parametrize("src_blocks,dst_blocks", CASES)
def test_torch_copy_is_a_copy_of_each_block(src_blocks, dst_blocks):
    src, dst = cache(10, seed=1), cache(12, seed=2)
    want = per_block(src, dst, src_blocks, dst_blocks)
    sgdma.copy_blocks(src, dst, src_blocks, dst_blocks)
    assert torch.equal(dst, want)


def test_mismatched_caches_are_refused():
    with pytest.raises(AssertionError):
        sgdma.copy_blocks(cache(4), cache(4)[:, :2].contiguous(), [0], [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("src_blocks,dst_blocks", CASES)
def test_sgdma_matches_the_torch_copy_byte_for_byte(to_host, src_blocks, dst_blocks):
    assert sgdma.why_off(torch.device("cuda")) is None, "sgDMA did not build: the test would compare the twin to itself"
    src = cache(10, pin=True, seed=1) if not to_host else cache(10, "cuda", seed=1)
    dst = cache(12, pin=True, seed=2) if to_host else cache(12, "cuda", seed=2)
    want = dst.clone() if dst.is_cuda else dst.clone().pin_memory()
    sgdma.torch_copy_blocks(src, want, src_blocks, dst_blocks)
    sgdma.copy_blocks(src, dst, src_blocks, dst_blocks)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16).cpu(), want.view(torch.int16).cpu())
    assert torch.equal(dst.cpu(), per_block(src.cpu(), cache(12, seed=2), src_blocks, dst_blocks))


def test_row_pitch_of_a_cache_and_of_one_layer():
    full = cache(10)
    size = full.element_size()
    assert sgdma._row_pitch(full) == full.stride(1) * size == 10 * full[0, 0, 0].numel() * size
    assert sgdma._row_pitch(full[:, 1:2]) == full.stride(0) * size  # K then V of layer 1
    assert sgdma._row_pitch(full[:, ::2]) is None  # layers 0 and 2: two pitches
