// The chain of one-row kernels that hop_bench.cu and stream_beside_bench.cu time: 128 threads a CTA, each kernel
// reading the 1024-long bf16 row the kernel before wrote and writing 4 of the next one.
#pragma once
#include <cuda_bf16.h>

#include "graph_timing.cuh"

constexpr int kThreads = 128, kK = 1024, kOut = 4;

// a summed over the CTA (the warps' sums meet in sums)
__device__ __forceinline__ float block_sum(float a, float* sums) {
  for (int o = 16; o; o /= 2) a += __shfl_xor_sync(~0u, a, o);
  if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = a;
  __syncthreads();
  return sums[0] + sums[1] + sums[2] + sums[3];
}

// The row (through L2 where the kernel before wrote it; SHARED: already in shared memory) and its sum of squares
// over the CTA (an RMSNorm's reduction).
template <bool SHARED = false>
__device__ __forceinline__ float sum_of_squares(const __nv_bfloat16* x, float* sums) {
  const uint4* row = reinterpret_cast<const uint4*>(x);
  uint4 v = SHARED ? row[threadIdx.x] : __ldcg(row + threadIdx.x);
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
  float a = 0.f;
  for (int i = 0; i < 8; ++i) a += __bfloat162float(e[i]) * __bfloat162float(e[i]);
  return block_sum(a, sums);
}

// Ends the capture of a chain of `chain` kernels on stream, times it and prints its table row (us a kernel).
inline int print_chain_row(cudaStream_t stream, const char* name, int stage, int ctas, int chain) {
  float us;
  if (time_capture(stream, &us)) return 1;
  printf("| %s | %s | %d | %d | %.3f |\n", name, stage ? "row read + block sum" : "none", ctas, chain, us / chain);
  return 0;
}
