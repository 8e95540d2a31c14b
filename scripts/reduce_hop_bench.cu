// Per-hop latency of a chain of one-row kernels whose CTAs each ADD a partial row into the next row (a split-K
// GEMV's reduction done in L2 by atomics), against the engine's hand-off where each CTA writes its own 4 outputs
// (hop_bench.cu's mode 0). What a bs=1 layer would pay if down_proj's product were split over the intermediate
// dimension inside the gate_up kernel (and o_proj's over the heads inside the attention): one hand-off a reduction
// instead of one a GEMV. PDL launches, griddepcontrol.wait, 140 kernels in one graph.
//   mode 0: bf16 row, each CTA writes 4 outputs (the engine's hand-off)
//   mode 1: fp32 accumulator row, every CTA adds 1024 partials (red.global.add.v4.f32)
//   mode 2: int64 fixed-point accumulator row (2^-32 units; integer adds, so the sum is the same in any order),
//           every CTA adds 1024 partials (red.global.add.u64)
//   mode 3 / 4: mode 1 / 2 after a sum over a cluster of 8 CTAs in distributed shared memory (each CTA adds 128,
//           one scalar red a thread; CTAs rounded down to a multiple of 8)
//   mode 5: no atomics: each CTA writes 4 fp32 outputs into one of 8 partial rows (as 8 clusters would, each after
//           summing its CTAs' partials in distributed shared memory), and the next kernel's CTAs sum the 8 rows
//           (all 16 loads of a thread issued at once): the reader's side of a split-K over 8 clusters
// stage 0: no input read; 1: the input row read through L2 + a block-wide sum (an RMSNorm's reduction).
//   nvcc -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/reduce_hop_bench scripts/reduce_hop_bench.cu && /tmp/reduce_hop_bench
#include <cstdlib>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "graph_timing.cuh"
#include "one_row_chain.cuh"

namespace cg = cooperative_groups;

constexpr int kCluster = 8, kPer = kK / kThreads;  // 8 elements a thread
constexpr float kFixed = 4294967296.f;  // 2^32

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(unsigned long long v) { return __ll2float_rn(static_cast<long long>(v)) / kFixed; }

// the accumulator row's 8 elements of this thread, through L2, and their sum of squares over the CTA
template <typename T>
__device__ float acc_sum_of_squares(const T* x, float* sums) {
  float a = 0.f;
  for (int i = 0; i < kPer; ++i) {
    const float v = to_float(__ldcg(x + threadIdx.x * kPer + i));
    a += v * v;
  }
  return block_sum(a, sums);
}

__device__ __forceinline__ void add(float* y, const float* v, int n) {
  if (n == 1) return static_cast<void>(atomicAdd(y, v[0]));
  for (int i = 0; i < n; i += 4) atomicAdd(reinterpret_cast<float4*>(y + i), make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]));
}
__device__ __forceinline__ void add(unsigned long long* y, const float* v, int n) {
  for (int i = 0; i < n; ++i) atomicAdd(y + i, static_cast<unsigned long long>(__float2ll_rn(v[i] * kFixed)));
}

template <int MODE, int STAGE>
__global__ void __launch_bounds__(kThreads) reduce_hop(void* rows_, int k) {
  using T = std::conditional_t<MODE == 2 || MODE == 4, unsigned long long, float>;  // the accumulator's word
  __shared__ float sums[kThreads / 32];
  __shared__ float partial[MODE >= 3 ? kK : 1];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  T* rows = static_cast<T*>(rows_);
  const T* x = rows + (k % 3) * kK;
  T* y = rows + ((k + 1) % 3) * kK;
  T* z = rows + ((k + 2) % 3) * kK;  // read by the kernel before, added to by the next: zeroed here
  const float s = STAGE ? acc_sum_of_squares(x, sums) : 1.f;
  const int mine = blockIdx.x * kThreads + threadIdx.x;
  if (mine < kK) z[mine] = 0;
  float v[kPer];
  for (int i = 0; i < kPer; ++i) v[i] = rsqrtf(s / kK + 1e-6f) * 1e-3f * (i + 1);
  if constexpr (MODE < 3) {
    add(y + threadIdx.x * kPer, v, kPer);
  } else {
    for (int i = 0; i < kPer; ++i) partial[threadIdx.x * kPer + i] = v[i];
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int column = cluster.block_rank() * (kK / kCluster) + threadIdx.x;  // kK / kCluster == kThreads
    float total = 0.f;
    for (int r = 0; r < kCluster; ++r) total += cluster.map_shared_rank(partial, r)[column];
    add(y + column, &total, 1);
    cluster.sync();
  }
}

// mode 5: rows holds two sets of kPartials fp32 rows; stage k reads set k % 2 and writes into the other
constexpr int kPartials = 8;
template <int STAGE>
__global__ void __launch_bounds__(kThreads) partial_rows_hop(float* rows, int k) {
  __shared__ float sums[kThreads / 32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const float4* x = reinterpret_cast<const float4*>(rows + (k % 2) * kPartials * kK);
  float* y = rows + ((k + 1) % 2) * kPartials * kK;
  float s = 1.f;
  if (STAGE) {
    float4 v[kPartials][2];
    for (int p = 0; p < kPartials; ++p)
      for (int h = 0; h < 2; ++h) v[p][h] = __ldcg(x + p * (kK / 4) + 2 * threadIdx.x + h);
    float a = 0.f;
    for (int h = 0; h < 2; ++h) {
      float4 t = v[0][h];
      for (int p = 1; p < kPartials; ++p) t.x += v[p][h].x, t.y += v[p][h].y, t.z += v[p][h].z, t.w += v[p][h].w;
      a += t.x * t.x + t.y * t.y + t.z * t.z + t.w * t.w;
    }
    s = block_sum(a, sums);
  }
  if (threadIdx.x < kOut)
    y[(blockIdx.x % kPartials) * kK + (blockIdx.x / kPartials * kOut + threadIdx.x) % kK] = rsqrtf(s / kK + 1e-6f) * 1e-3f;
}

// mode 0: hop_bench.cu's mode 0, stage as given
template <int STAGE>
__global__ void __launch_bounds__(kThreads) write_hop(const __nv_bfloat16* x, __nv_bfloat16* y) {
  __shared__ float sums[kThreads / 32];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const float s = STAGE ? sum_of_squares(x, sums) : 1.f;
  if (threadIdx.x < kOut) y[(blockIdx.x * kOut + threadIdx.x) % kK] = __float2bfloat16(rsqrtf(s / kK + 1e-6f) * 0.5f);
}

// config (made by pdl_config with attributes) launches in clusters of kCluster CTAs
inline void add_cluster(cudaLaunchConfig_t& config, cudaLaunchAttribute (&attributes)[2]) {
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = kCluster, attributes[1].val.clusterDim.y = 1, attributes[1].val.clusterDim.z = 1;
  config.numAttrs = 2;
}

constexpr size_t kRowBytes = 2 * kPartials * kK * sizeof(float);  // >= 3 int64 rows

const char* const kModeNames[] = {"each CTA writes 4 bf16", "fp32 red.v4, 1024 a CTA", "int64 red, 1024 a CTA",
                                  "8-CTA cluster sum, fp32 red", "8-CTA cluster sum, int64 red",
                                  "8 fp32 partial rows, summed by the reader"};

template <int MODE, int STAGE>
int run(int ctas, int chain, char* rows, cudaStream_t stream) {
  if (MODE == 3 || MODE == 4) ctas -= ctas % kCluster;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cudaMemsetAsync(rows, 0, kRowBytes, stream);
  for (int k = 0; k < chain; ++k) {
    cudaLaunchAttribute attributes[2];
    cudaLaunchConfig_t config = pdl_config(dim3(ctas), dim3(kThreads), stream, attributes);
    if constexpr (MODE == 0) {
      __nv_bfloat16* r = reinterpret_cast<__nv_bfloat16*>(rows);
      CHECK(cudaLaunchKernelEx(&config, write_hop<STAGE>, r + (k % 2) * kK, r + ((k + 1) % 2) * kK));
    } else if constexpr (MODE == 5) {
      CHECK(cudaLaunchKernelEx(&config, partial_rows_hop<STAGE>, reinterpret_cast<float*>(rows), k));
    } else {
      if (MODE >= 3) add_cluster(config, attributes);
      CHECK(cudaLaunchKernelEx(&config, reduce_hop<MODE, STAGE>, static_cast<void*>(rows), k));
    }
  }
  return print_chain_row(stream, kModeNames[MODE], STAGE, ctas, chain);
}

template <int MODE>
int run_mode(int ctas, int chain, char* rows, cudaStream_t stream) {
  return run<MODE, 0>(ctas, chain, rows, stream) || run<MODE, 1>(ctas, chain, rows, stream);
}

// checks that one kernel of mode 2 / 4 sums every CTA's partials (into a zeroed row, read back): within 1e-5 of the
// exact total, each partial being rounded to 2^-32 units
template <int MODE>
int check_sum(int ctas, char* rows, cudaStream_t stream) {
  CHECK(cudaMemset(rows, 0, 3 * kK * sizeof(unsigned long long)));
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config = pdl_config(dim3(ctas), dim3(kThreads), stream, attributes);
  if (MODE >= 3) add_cluster(config, attributes);
  CHECK(cudaLaunchKernelEx(&config, reduce_hop<MODE, 0>, static_cast<void*>(rows), 0));
  unsigned long long got[kK];
  CHECK(cudaMemcpy(got, rows + kK * sizeof(unsigned long long), sizeof(got), cudaMemcpyDeviceToHost));
  const double one = 1e-3 * kFixed / sqrt(1. / kK + 1e-6);
  double worst = 0.;
  for (int e = 0; e < kK; ++e) {
    const double want = static_cast<double>(ctas) * one * (e % kPer + 1);
    worst = fmax(worst, fabs(static_cast<long long>(got[e]) - want) / want);
  }
  printf("check mode %d, %d CTAs: largest relative error of the sums %.2e\n", MODE, ctas, worst);
  return worst > 1e-5;
}

// argument: one mode to run (default: every mode)
int main(int argc, char** argv) {
  const int only = argc > 1 ? atoi(argv[1]) : -1;
  setvbuf(stdout, nullptr, _IONBF, 0);
  char* rows;
  CHECK(cudaMalloc(&rows, kRowBytes));
  cudaStream_t stream; cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (check_sum<2>(264, rows, stream) || check_sum<4>(264, rows, stream)) return 1;
  printf("| reduction | after it | CTAs | kernels | us a kernel |\n|---|---|---|---|---|\n");
  using Run = int (*)(int, int, char*, cudaStream_t);
  const Run modes[] = {run_mode<0>, run_mode<1>, run_mode<2>, run_mode<3>, run_mode<4>, run_mode<5>};
  for (int ctas : {132, 264})
    for (int mode = 0; mode < 6; ++mode)
      if ((only < 0 || only == mode) && modes[mode](ctas, 140, rows, stream)) return 1;
  return 0;
}
