// sgDMA: whole KV blocks copied between two block caches of one layout, [rows, blocks, block bytes] with rows = K/V x
// layers (the device cache and the pinned host pool, either direction), one cudaMemcpy2DAsync a run of blocks: a
// block's bytes are `rows` pieces of `width` bytes, a pitch apart (the blocks of a row of the cache). Blocks whose
// ids follow each other in both caches go as one wider copy. The copies are queued on `stream` and nothing waits
// for them here. Twin: torch index copies (nanovllm/comm/sgdma.py).
#include "common.cuh"

extern "C" int nanovllm_sgdma(char* dst, const char* src, const int64_t* dst_blocks, const int64_t* src_blocks,
                              int count, size_t width, size_t rows, size_t dst_pitch, size_t src_pitch,
                              cudaStream_t stream) {
  for (int i = 0; i < count;) {
    int run = 1;
    while (i + run < count && dst_blocks[i + run] == dst_blocks[i] + run && src_blocks[i + run] == src_blocks[i] + run)
      ++run;
    cudaError_t error = cudaMemcpy2DAsync(dst + dst_blocks[i] * width, dst_pitch, src + src_blocks[i] * width,
                                          src_pitch, width * run, rows, cudaMemcpyDefault, stream);
    if (error != cudaSuccess) return error;
    i += run;
  }
  return cudaSuccess;
}
