// Per-hop latency of a chain of dependent one-row kernels (bs=1 decode's shape: 264 CTAs of 128 threads, each
// reading the whole 1024-long row the kernel before wrote and writing its 4 of the next row), in one CUDA graph,
// by how one kernel hands off to the next (docs/benchmarks.md, eighteenth session):
//   mode 0: programmatic dependent launch, griddepcontrol.wait (the engine's hand-off)
//   mode 1: PDL launch, but a counter in global memory instead of the wait (each CTA: barrier, release add;
//           the next kernel's CTAs: acquire spin until every CTA of the kernel before has added)
//   mode 2: plain launches (no PDL)
//   mode 3: mode 1 with __nanosleep in the spin
//   mode 4: one persistent kernel, a counter a stage (a megakernel's hand-off)
//   mode 5: mode 0 with every other kernel 128 CTAs in clusters of 16 (a bs=1 layer's decode attention)
//   mode 6: mode 5 without the clusters (every other kernel 128 CTAs)
// stage 0: no input read (the hop alone); 1: the input row read through L2 + a block-wide sum (an RMSNorm's
// reduction) before the outputs.
//   nvcc -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/hop_bench scripts/hop_bench.cu && /tmp/hop_bench
#include <cuda_bf16.h>

#include "graph_timing.cuh"
#include "one_row_chain.cuh"

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void red_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(p) : "memory"); }

template <int MODE, int STAGE>
__global__ void __launch_bounds__(kThreads) hop(const __nv_bfloat16* x, __nv_bfloat16* y, unsigned* counters, int k) {
  __shared__ float sums[kThreads / 32];
  if (MODE != 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (MODE == 0 || MODE == 5 || MODE == 6) asm volatile("griddepcontrol.wait;" ::: "memory");
  if ((MODE == 1 || MODE == 3) && k > 0) {
    if (threadIdx.x == 0) while (ld_acquire(counters + k - 1) < gridDim.x) { if (MODE == 3) __nanosleep(64); }
    __syncthreads();
  }
  const float s = STAGE ? sum_of_squares(x, sums) : 1.f;
  if (threadIdx.x < kOut) y[(blockIdx.x * kOut + threadIdx.x) % kK] = __float2bfloat16(rsqrtf(s / kK + 1e-6f) * 0.5f);
  if (MODE == 1 || MODE == 3) {
    __syncthreads();
    if (threadIdx.x == 0) red_release(counters + k);
  }
}

// every stage in one persistent kernel: a counter a stage, as a megakernel would hand off
template <int STAGE>
__global__ void __launch_bounds__(kThreads) stages(__nv_bfloat16* rows, unsigned* counters, int chain) {
  __shared__ float sums[kThreads / 32];
  for (int k = 0; k < chain; ++k) {
    const __nv_bfloat16* x = rows + (k % 2) * kK;
    __nv_bfloat16* y = rows + ((k + 1) % 2) * kK;
    if (k > 0) {
      if (threadIdx.x == 0) while (ld_acquire(counters + k - 1) < gridDim.x) {}
      __syncthreads();
    }
    const float s = STAGE ? sum_of_squares(x, sums) : 1.f;
    if (threadIdx.x < kOut) __stcg(y + (blockIdx.x * kOut + threadIdx.x) % kK, __float2bfloat16(rsqrtf(s / kK + 1e-6f) * 0.5f));
    __syncthreads();
    if (threadIdx.x == 0) red_release(counters + k);
  }
}

template <int MODE, int STAGE>
int run(int ctas, int chain, __nv_bfloat16* rows, unsigned* counters, cudaStream_t stream) {
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaMemsetAsync(counters, 0, chain * sizeof(unsigned), stream);
  if (MODE == 4) stages<STAGE><<<ctas, kThreads, 0, stream>>>(rows, counters, chain);
  for (int k = 0; MODE != 4 && k < chain; ++k) {
    cudaLaunchAttribute attribute;
    cudaLaunchConfig_t config = pdl_config(dim3(ctas), dim3(kThreads), stream, &attribute);
    config.numAttrs = MODE == 2 ? 0 : 1;
    cudaLaunchAttribute attributes[2] = {attribute, {}};
    if ((MODE == 5 || MODE == 6) && k % 2 == 1) {
      config.gridDim = dim3(128);
      attributes[1].id = cudaLaunchAttributeClusterDimension;
      attributes[1].val.clusterDim.x = 16, attributes[1].val.clusterDim.y = 1, attributes[1].val.clusterDim.z = 1;
      config.attrs = attributes;
      config.numAttrs = MODE == 5 ? 2 : 1;
    }
    CHECK(cudaLaunchKernelEx(&config, hop<MODE, STAGE>, rows + (k % 2) * kK, rows + ((k + 1) % 2) * kK, counters, k));
  }
  CHECK(cudaStreamEndCapture(stream, &graph));
  float us;
  if (time_graph(graph, stream, &us)) return 1;
  printf("| %s | %s | %d | %d | %.3f |\n", MODE == 5 ? "PDL wait, every other kernel 16-CTA clusters" : MODE == 6 ? "PDL wait, every other kernel 128 CTAs" : MODE == 0 ? "PDL wait" : MODE == 1 ? "PDL + counter" : MODE == 3 ? "PDL + counter, nanosleep" : MODE == 4 ? "one persistent kernel, counters" : "plain",
         STAGE ? "row read + block sum" : "none", ctas, chain, us / chain);
  return 0;
}

int main() {
  __nv_bfloat16* rows; unsigned* counters;
  CHECK(cudaMalloc(&rows, 2 * kK * sizeof(__nv_bfloat16)));
  CHECK(cudaMemset(rows, 0, 2 * kK * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&counters, 4096 * sizeof(unsigned)));
  CHECK(cudaFuncSetAttribute(hop<5, 0>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CHECK(cudaFuncSetAttribute(hop<5, 1>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t stream; cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  printf("| hand-off | after it | CTAs | kernels | us a kernel |\n|---|---|---|---|---|\n");
  for (int ctas : {132, 264}) {
    run<2, 0>(ctas, 140, rows, counters, stream);
    run<0, 0>(ctas, 140, rows, counters, stream);
    run<1, 0>(ctas, 140, rows, counters, stream);
    run<2, 1>(ctas, 140, rows, counters, stream);
    run<0, 1>(ctas, 140, rows, counters, stream);
    run<1, 1>(ctas, 140, rows, counters, stream);
    run<3, 0>(ctas, 140, rows, counters, stream);
    run<3, 1>(ctas, 140, rows, counters, stream);
    run<4, 0>(ctas, 140, rows, counters, stream);
    run<4, 1>(ctas, 140, rows, counters, stream);
    run<5, 0>(ctas, 140, rows, counters, stream);
    run<5, 1>(ctas, 140, rows, counters, stream);
    run<6, 0>(ctas, 140, rows, counters, stream);
    run<6, 1>(ctas, 140, rows, counters, stream);
  }
  return 0;
}
