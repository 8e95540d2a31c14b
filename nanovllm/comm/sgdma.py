"""sgDMA: whole KV blocks (every layer, K and V) copied between two block caches of one layout, [2, layers, blocks,
...] (the device KV cache and a pinned host pool), in either direction; or one layer's, views [2, 1, blocks, ...].
On CUDA, csrc/sgdma.cu queues one cudaMemcpy2DAsync per run of consecutive blocks on the current stream (built by
nvcc at first use; nothing waits for it, so later work on that stream sees the copy and the host does not block).
Elsewhere (CPU, no nvcc, a host side that is not pinned, NANOVLLM_SGDMA=0) torch index copies do the same, its
twin, and the log says so once."""
import ctypes

import torch

BLOCK_DIM = 2  # [K/V, layers, blocks, block_size, kv_heads, head_dim]


def why_off(device: torch.device) -> str | None:
    """None when sgDMA serves copies to and from this CUDA device, else why not (logged once)."""
    from nanovllm.kernels import cuda_library  # imports Triton: CUDA machines only

    return cuda_library.entry_point(
        "sgdma", device, "NANOVLLM_SGDMA",
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_size_t] * 4
        + [ctypes.c_void_p],
        "KV blocks move between GPU and host memory by sgDMA (csrc/sgdma.cu: cudaMemcpy2DAsync per run of blocks)",
        "KV blocks move between GPU and host memory by torch index copies: sgDMA is off ({reason})", hopper=False)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]):
    """dst[:, :, dst_blocks[i]] = src[:, :, src_blocks[i]] for every i."""
    assert len(src_blocks) == len(dst_blocks) and src.dtype == dst.dtype
    assert src.shape[:BLOCK_DIM] == dst.shape[:BLOCK_DIM] and src.shape[BLOCK_DIM + 1:] == dst.shape[BLOCK_DIM + 1:]
    if not src_blocks:
        return
    if _sgdma_serves(src, dst):
        _sgdma(src, dst, src_blocks, dst_blocks)
    else:
        torch_copy_blocks(src, dst, src_blocks, dst_blocks)


def torch_copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]):
    """The twin: a gather on the source's side, one copy across, a scatter on the destination's."""
    gathered = src[:, :, torch.tensor(src_blocks, device=src.device)]
    # blocking into host memory (an asynchronous copy would be read before it lands), queued into the device's
    dst[:, :, torch.tensor(dst_blocks, device=dst.device)] = gathered.to(dst.device, non_blocking=dst.is_cuda)


def _row_pitch(cache: torch.Tensor) -> int | None:
    """Bytes from one [blocks, ...] row of the cache (a K/V of a layer) to the next, where the first two dims are one
    evenly strided run of rows over contiguous blocks; else None."""
    if not cache[0, 0].is_contiguous():
        return None
    if cache.shape[1] == 1:
        return cache.stride(0) * cache.element_size()
    if cache.shape[0] == 1 or cache.stride(0) == cache.shape[1] * cache.stride(1):
        return cache.stride(1) * cache.element_size()
    return None


def _sgdma_serves(src: torch.Tensor, dst: torch.Tensor) -> bool:
    if src.device.type == dst.device.type == "cpu" or _row_pitch(src) is None or _row_pitch(dst) is None:
        return False
    gpu = src.device if src.is_cuda else dst.device
    host = dst if src.is_cuda else src
    return (host.is_cuda or host.is_pinned()) and why_off(gpu) is None


def _sgdma(src: torch.Tensor, dst: torch.Tensor, src_blocks: list[int], dst_blocks: list[int]):
    from nanovllm.kernels import cuda_library

    rows = src.shape[0] * src.shape[1]
    width = src[0, 0, 0].numel() * src.element_size()
    src_ids = torch.tensor(src_blocks, dtype=torch.int64)
    dst_ids = torch.tensor(dst_blocks, dtype=torch.int64)
    library = cuda_library.library("sgdma")
    error = library.nanovllm_sgdma(dst.data_ptr(), src.data_ptr(), dst_ids.data_ptr(), src_ids.data_ptr(),
                                   len(src_blocks), width, rows, _row_pitch(dst), _row_pitch(src),
                                   cuda_library.stream_of(src if src.is_cuda else dst))
    cuda_library.check(library, error, "sgdma")
