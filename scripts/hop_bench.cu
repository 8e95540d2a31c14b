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
//   mode 7: one persistent kernel, rows in the low-latency (LL) format below: no counter, the reader polls the data
//   mode 8: PDL launches, LL rows, no griddepcontrol.wait; a kernel lets the next launch once its input is in
//   mode 9: mode 1 with the next kernel launched once the counter is seen (not at the start)
//   mode 10 / 11: mode 7 / 8 with one line polled by one thread before the row is read
// stage 0: no input read (the hop alone); 1: the input row read through L2 + a block-wide sum (an RMSNorm's
// reduction) before the outputs.
//   nvcc -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/hop_bench scripts/hop_bench.cu && /tmp/hop_bench
#include <cstdlib>

#include <cuda_bf16.h>

#include "graph_timing.cuh"
#include "one_row_chain.cuh"

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void red_release(unsigned* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(p) : "memory"); }

// LL rows (the flag beside the data, as NCCL's low-latency protocol): a 1024-long bf16 row is kLines lines of 16
// bytes, each two 8-byte words {bf16 x 2, flag}. A word is written and read in one single-copy-atomic access, so a
// reader that sees the flag sees the data: no fence, no counter, one trip through L2.
constexpr int kLines = kK / 4;

__device__ __forceinline__ void ld_line(const uint4* p, unsigned long long& a, unsigned long long& b) {
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory"); }
__device__ __forceinline__ void st_line(uint4* p, unsigned long long a, unsigned long long b) {
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" :: "l"(p), "l"(a), "l"(b) : "memory"); }

// Thread 0 polls one line (written by another CTA) until its flag is at least `flag`; the CTA waits for it.
__device__ __forceinline__ void ll_wait_line(const uint4* lines, unsigned flag) {
  unsigned long long a, b;
  if (threadIdx.x == 0) do ld_line(lines + (blockIdx.x + 37) % kLines, a, b); while (static_cast<unsigned>(a >> 32) < flag);
  __syncthreads();
}

// The row with this flag (polled until every word carries it; thread t reads lines 2t and 2t + 1) and its sum of
// squares over the CTA. LEAD: thread 0 polls one line first, the others read once it is in (fewer polls in L2).
template <bool LEAD>
__device__ float ll_sum_of_squares(const uint4* lines, unsigned flag, float* sums) {
  if (LEAD) ll_wait_line(lines, flag);
  unsigned long long w[4];
  bool ready;
  do {
    ld_line(lines + 2 * threadIdx.x, w[0], w[1]);
    ld_line(lines + 2 * threadIdx.x + 1, w[2], w[3]);
    ready = true;
    for (int i = 0; i < 4; ++i) ready &= static_cast<unsigned>(w[i] >> 32) == flag;
  } while (!ready);
  float a = 0.f;
  for (int i = 0; i < 4; ++i) {
    const unsigned bits = static_cast<unsigned>(w[i]);
    const __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&bits);
    a += __bfloat162float(pair.x) * __bfloat162float(pair.x) + __bfloat162float(pair.y) * __bfloat162float(pair.y);
  }
  return block_sum(a, sums);
}

// Stage k's input, flag k (none at k = 0): the row's sum of squares, or with STAGE 0 one line (the hop alone).
template <int STAGE, bool LEAD>
__device__ __forceinline__ float ll_input(const uint4* lines, int k, float* sums) {
  if (k > 0 && STAGE) return ll_sum_of_squares<LEAD>(lines, k, sums);
  if (k > 0) ll_wait_line(lines, k);
  return 1.f;
}

// The CTA's share of the next row (every line is written by some CTA: line blockIdx.x + t * gridDim.x, thread t).
__device__ __forceinline__ void ll_write(uint4* lines, float s, unsigned flag) {
  const int line = blockIdx.x + threadIdx.x * gridDim.x;
  if (threadIdx.x < 2 && line < kLines) {
    const __nv_bfloat162 pair = __float2bfloat162_rn(rsqrtf(s / kK + 1e-6f) * 0.5f);
    const unsigned long long word = static_cast<unsigned long long>(flag) << 32 | *reinterpret_cast<const unsigned*>(&pair);
    st_line(lines + line, word, word);
  }
}

template <int MODE, int STAGE, bool LEAD = MODE == 11>
__global__ void __launch_bounds__(kThreads) hop(const __nv_bfloat16* x, __nv_bfloat16* y, unsigned* counters, int k) {
  __shared__ float sums[kThreads / 32];
  if (MODE == 8 || MODE == 11) {  // row k - 1 -> k, flags k and k + 1
    const float s = ll_input<STAGE, LEAD>(reinterpret_cast<const uint4*>(x), k, sums);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    ll_write(reinterpret_cast<uint4*>(y), s, k + 1);
    return;
  }
  if (MODE != 2 && MODE != 9) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // at the start
  if (MODE == 0 || MODE == 5 || MODE == 6) asm volatile("griddepcontrol.wait;" ::: "memory");
  if ((MODE == 1 || MODE == 3 || MODE == 9) && k > 0) {
    if (threadIdx.x == 0) while (ld_acquire(counters + k - 1) < gridDim.x) { if (MODE == 3) __nanosleep(64); }
    __syncthreads();
  }
  if (MODE == 9) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // once the counter is seen
  const float s = STAGE ? sum_of_squares(x, sums) : 1.f;
  if (threadIdx.x < kOut) y[(blockIdx.x * kOut + threadIdx.x) % kK] = __float2bfloat16(rsqrtf(s / kK + 1e-6f) * 0.5f);
  if (MODE == 1 || MODE == 3 || MODE == 9) {
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

// every stage in one persistent kernel, LL rows: stage k reads the row with flag k and writes the next with k + 1
// (the hop alone: a CTA may run stages ahead of another, so its one line is polled for a flag >= k)
template <int STAGE, bool LEAD>
__global__ void __launch_bounds__(kThreads) ll_stages(uint4* rows, int chain) {
  __shared__ float sums[kThreads / 32];
  for (int k = 0; k < chain; ++k) {
    const float s = ll_input<STAGE, LEAD>(rows + (k % 2) * kLines, k, sums);
    ll_write(rows + ((k + 1) % 2) * kLines, s, k + 1);
  }
}

const char* const kModeNames[] = {
    "PDL wait", "PDL + counter", "plain", "PDL + counter, nanosleep", "one persistent kernel, counters",
    "PDL wait, every other kernel 16-CTA clusters", "PDL wait, every other kernel 128 CTAs",
    "one persistent kernel, LL rows", "PDL, LL rows, next launched once the row is in",
    "PDL + counter, next launched once it is seen", "one persistent kernel, LL rows, one line polled first",
    "PDL, LL rows, one line polled first"};

template <int MODE, int STAGE>
int run(int ctas, int chain, __nv_bfloat16* rows, unsigned* counters, cudaStream_t stream) {
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaMemsetAsync(counters, 0, chain * sizeof(unsigned), stream);
  if (MODE == 7 || MODE == 8 || MODE == 10 || MODE == 11) cudaMemsetAsync(rows, 0, 2 * kLines * sizeof(uint4), stream);
  if (MODE == 7 || MODE == 10)
    ll_stages<STAGE, MODE == 10><<<ctas, kThreads, 0, stream>>>(reinterpret_cast<uint4*>(rows), chain);
  if (MODE == 4) stages<STAGE><<<ctas, kThreads, 0, stream>>>(rows, counters, chain);
  for (int k = 0; MODE != 4 && MODE != 7 && MODE != 10 && k < chain; ++k) {
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
    const int row = MODE == 8 || MODE == 11 ? 2 * kK : kK;  // elements: an LL row is 4 KB, twice a bf16 row
    CHECK(cudaLaunchKernelEx(&config, hop<MODE, STAGE>, rows + (k % 2) * row, rows + ((k + 1) % 2) * row, counters, k));
  }
  return print_chain_row(stream, kModeNames[MODE], STAGE, ctas, chain);
}

// both stages of one mode
template <int MODE>
int run_mode(int ctas, int chain, __nv_bfloat16* rows, unsigned* counters, cudaStream_t stream) {
  return run<MODE, 0>(ctas, chain, rows, counters, stream) || run<MODE, 1>(ctas, chain, rows, counters, stream);
}

// argument: one mode to run (default: every mode)
int main(int argc, char** argv) {
  const int only = argc > 1 ? atoi(argv[1]) : -1;
  setvbuf(stdout, nullptr, _IONBF, 0);
  __nv_bfloat16* rows; unsigned* counters;
  CHECK(cudaMalloc(&rows, 2 * kLines * sizeof(uint4)));  // two LL rows, or two bf16 rows in their front
  CHECK(cudaMemset(rows, 0, 2 * kLines * sizeof(uint4)));
  CHECK(cudaMalloc(&counters, 4096 * sizeof(unsigned)));
  CHECK(cudaFuncSetAttribute(hop<5, 0>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CHECK(cudaFuncSetAttribute(hop<5, 1>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t stream; cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  printf("| hand-off | after it | CTAs | kernels | us a kernel |\n|---|---|---|---|---|\n");
  using Run = int (*)(int, int, __nv_bfloat16*, unsigned*, cudaStream_t);
  const Run modes[] = {run_mode<0>, run_mode<1>, run_mode<2>, run_mode<3>, run_mode<4>,
                       run_mode<5>, run_mode<6>, run_mode<7>, run_mode<8>, run_mode<9>, run_mode<10>, run_mode<11>};
  for (int ctas : {132, 264})
    for (int mode : {2, 0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11})
      if ((only < 0 || only == mode) && modes[mode](ctas, 140, rows, counters, stream)) return 1;
  return 0;
}
