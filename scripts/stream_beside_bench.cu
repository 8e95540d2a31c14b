// How much does a weight stream beside a chain of dependent one-row kernels slow the chain? The chain is
// hop_bench.cu's (PDL wait, each kernel reads the row the one before wrote through L2, a block-wide sum, 264 CTAs
// x 128 threads, 140 kernels in one CUDA graph); every kernel also moves S bytes of fresh data out of HBM (its
// CTAs' shares, a 1 GB buffer walked so nothing is in L2):
//   how 0: bulk L2 prefetches (cp.async.bulk.prefetch.L2, 16 KB pieces) from thread 0, nothing waits for them
//   how 1: line prefetches (prefetch.global.L2::evict_last from warp 1's lanes), nothing waits for them
//   how 2: bulk copies into shared memory from thread 0 (16 KB pieces into one 16 KB buffer), waited for before the
//          CTA exits
// where 0: before the PDL wait; 1: right after it (before the row read).
// Prints us a kernel and the stream's rate if the kernel's time carried it. The "lonely" rows put all of the
// 140 kernels' bytes into every 4th kernel: if a kernel's end waited for its prefetches, those kernels would take
// ~4x as long and the chain the same; if not, the chain stays at the hop.
// "row by bulk copy": the chain's row read through the TMA unit as well (does a CTA's copy queue behind its prefetches?)
//   nvcc -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/stream_beside scripts/stream_beside_bench.cu && /tmp/stream_beside
// (any argument, e.g. `tma`: only the "row by bulk copy" rows)
#include <cuda_bf16.h>

#include "../csrc/common.cuh"  // mbarriers and bulk copies
#include "graph_timing.cuh"
#include "one_row_chain.cuh"

using namespace nanovllm;

constexpr int kPiece = 16384;
constexpr size_t kBuffer = size_t(1) << 30;

// this CTA's share [begin, end) of the kernel's S bytes
template <int HOW>
__device__ __forceinline__ void stream(const char* base, size_t begin, size_t end, char* buf, uint64_t* bar,
                                       int* pieces) {
  if (HOW == 0 && threadIdx.x == 0)
    for (size_t b = begin; b < end; b += kPiece)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + b), "r"(unsigned(min(end - b, size_t(kPiece)))) : "memory");
  if (HOW == 1 && threadIdx.x / 32 == 1)
    for (size_t b = begin + (threadIdx.x % 32) * 128; b < end; b += 32 * 128)
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + b) : "memory");
  if (HOW == 2 && threadIdx.x == 0) {
    int n = 0;
    for (size_t b = begin; b < end; b += kPiece, ++n) {
      const unsigned bytes = unsigned(min(end - b, size_t(kPiece)));
      barrier_expect(bar, bytes);
      bulk_copy(buf, base + b, bytes, bar);
    }
    *pieces = n;
  }
}

// the row through a bulk copy into shared memory (the TMA unit that the bulk streams use too), then the same sum
__device__ __forceinline__ float sum_of_squares_tma(const __nv_bfloat16* x, float* sums, __nv_bfloat16* row,
                                                    uint64_t* bar) {
  if (threadIdx.x == 0) {
    barrier_expect(bar, kK * 2);
    bulk_copy(row, x, kK * 2, bar);
  }
  barrier_wait(bar, 0);
  return sum_of_squares<true>(row, sums);
}

template <int HOW, int WHERE, int ROW_TMA = 0>
__global__ void __launch_bounds__(kThreads) hop(const __nv_bfloat16* x, __nv_bfloat16* y, const char* base, size_t bytes) {
  __shared__ float sums[kThreads / 32];
  __shared__ alignas(128) char buf[HOW == 2 ? kPiece : 16];
  __shared__ alignas(8) uint64_t bar, row_bar;
  __shared__ int pieces;
  __shared__ alignas(128) __nv_bfloat16 row[ROW_TMA ? kK : 8];
  if (threadIdx.x == 0 && (HOW == 2 || ROW_TMA)) {
    barrier_init(&bar, 1);
    barrier_init(&row_bar, 1);
    barriers_initialized();
  }
  // 16-byte aligned shares
  const size_t units = bytes / 16, begin = units * blockIdx.x / gridDim.x * 16, end = units * (blockIdx.x + 1) / gridDim.x * 16;
  launch_dependents();
  if (WHERE == 0) stream<HOW>(base, begin, end, buf, &bar, &pieces);
  wait_for_prior_kernel();
  if (WHERE == 1) stream<HOW>(base, begin, end, buf, &bar, &pieces);
  if (ROW_TMA) __syncthreads();  // the barrier's init seen by every thread
  const float s = ROW_TMA ? sum_of_squares_tma(x, sums, row, &row_bar) : sum_of_squares(x, sums);
  if (threadIdx.x < kOut) y[(blockIdx.x * kOut + threadIdx.x) % kK] = __float2bfloat16(rsqrtf(s / kK + 1e-6f) * 0.5f);
  if (HOW == 2 && threadIdx.x == 0)  // every piece's bytes landed (phase parity of the n-th completion)
    for (int i = 0; i < pieces; ++i) barrier_wait(&bar, i & 1);
}

template <int HOW, int WHERE, int ROW_TMA = 0>
int run(const char* label, size_t bytes, bool lonely, __nv_bfloat16* rows, const char* buffer, cudaStream_t stream) {
  const int ctas = 264, chain = 140;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  size_t offset = 0;
  for (int k = 0; k < chain; ++k) {
    const size_t mine = lonely ? (k % 4 == 0 ? 4 * bytes : 0) : bytes;
    if (offset + mine > kBuffer) offset = 0;
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = pdl_config(dim3(ctas), dim3(kThreads), stream, &attribute);
    CHECK(cudaLaunchKernelEx(&config, hop<HOW, WHERE, ROW_TMA>, rows + (k % 2) * kK, rows + ((k + 1) % 2) * kK, buffer + offset, mine));
    offset += mine;
  }
  float us;
  if (time_capture(stream, &us)) return 1;
  const float hop = us / chain;
  printf("| %s%s | %s | %.2f MB%s | %.3f | %.2f |\n", label, ROW_TMA ? ", row by bulk copy" : "", WHERE ? "after the wait" : "before the wait", bytes / 1048576.0,
         lonely ? " (x4 in every 4th kernel)" : "", hop, bytes / (hop * 1e-6) / 1e12);
  return 0;
}

int main(int argc, char** argv) {
  const bool only_tma = argc > 1;  // just the rows whose chain reads its row by bulk copy
  __nv_bfloat16* rows; char* buffer;
  CHECK(cudaMalloc(&rows, 2 * kK * sizeof(__nv_bfloat16)));
  CHECK(cudaMemset(rows, 0, 2 * kK * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&buffer, kBuffer));
  CHECK(cudaMemset(buffer, 1, kBuffer));
  cudaStream_t stream; cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  printf("| stream | issued | bytes a kernel | us a kernel | TB/s if carried |\n|---|---|---|---|---|\n");
  const size_t MB = 1 << 20;
  for (size_t bytes : {size_t(0), MB / 2, MB, 2 * MB, 3 * MB, 4 * MB}) {
    if (only_tma) break;
    run<0, 0>("bulk L2 prefetch", bytes, false, rows, buffer, stream);
    run<0, 1>("bulk L2 prefetch", bytes, false, rows, buffer, stream);
    run<1, 0>("line L2 prefetch", bytes, false, rows, buffer, stream);
    run<1, 1>("line L2 prefetch", bytes, false, rows, buffer, stream);
    run<2, 0>("bulk copy to smem, waited", bytes, false, rows, buffer, stream);
    run<2, 1>("bulk copy to smem, waited", bytes, false, rows, buffer, stream);
  }
  for (size_t bytes : {size_t(0), MB, 2 * MB, 3 * MB}) {
    run<0, 1, 1>("bulk L2 prefetch", bytes, false, rows, buffer, stream);
    run<1, 1, 1>("line L2 prefetch", bytes, false, rows, buffer, stream);
    run<0, 0, 1>("bulk L2 prefetch", bytes, false, rows, buffer, stream);
  }
  for (size_t bytes : {MB / 2, MB}) {
    if (only_tma) break;
    run<0, 1>("bulk L2 prefetch", bytes, true, rows, buffer, stream);
    run<1, 1>("line L2 prefetch", bytes, true, rows, buffer, stream);
    run<2, 1>("bulk copy to smem, waited", bytes, true, rows, buffer, stream);
  }
  return 0;
}
