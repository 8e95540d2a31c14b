// y = x W^T (+ b) for ONE row of x (bs=1 decode), Hopper (sm_90) and newer.
//
// Why a CUDA kernel: at one row the GEMV is a pure weight stream, and a Qwen3-0.6B layer's four weights
// (4-13 MB each) are too small for a kernel to reach HBM speed between its launch ramp and its tail. The weight
// does not depend on the kernel before, so each CTA copies its whole slice of W into shared memory (bulk async
// copies by a producer warp, which does not wait) while its compute warps are at the programmatic-dependent-launch
// wait, and lets the next kernel launch at once. Under PDL the next kernels' CTAs sit beside this one's (each takes
// <= 74 KB of shared memory and few registers) and stream their weights while this one waits and multiplies: on
// the H100, 28 kernels that only load 8.4 MB each this way ran at 3.0 TB/s in a graph, 1.9 without PDL (Triton
// cannot express this: its loads land in registers and its pipelines start after the wait). The critical path
// after the wait is kept short: one round trip for the input row, the fused operation once per CTA into shared
// memory, and warps that own whole rows of W, so that lane 0 writes each output.
//
// Each CTA owns rows_per_cta consecutive rows of W (contiguous [N, K]). The fused operation in front of the
// product, rounded where the torch twins round:
//   MODE_PLAIN     x
//   MODE_ADD_NORM  RMSNorm(x + residual) * norm_w; CTA 0 writes x + residual to res_out (the next residual)
//   MODE_SILU_MUL  silu(gate) * up, x being the stacked [gate | up] row (2K long)
// and behind it (SILU_OUT, with MODE_ADD_NORM: mode 3 of the entry point): W is a stacked [gate; up] weight of N
// rows, each CTA owns rows_per_cta rows of each half, and y = silu(x W_gate^T) * (x W_up^T), N / 2 wide, so that
// the next GEMV (down_proj) stages its input without the activation (down's SiLU staging of a 12 KB row read by
// every CTA took 1.8-5.6 us after its wait in a bs=1 Qwen3-0.6B layer; a plain one of 4 KB, 0.2-0.5).
// Reference: F.linear after layers.layernorm.rms_norm / layers.activation.SiluAndMul (nanovllm/kernels/gemv_one_row.py).
#include "common.cuh"

namespace {

using namespace nanovllm;

constexpr int kThreads = 128;  // bs=1 decode on the H100, one CTA a SM: 963-965 tok/s with 128, 893-899 with 256
constexpr int kWarps = kThreads / 32;
// W's slice arrives in up to kChunks pieces (a row at least), ONE in flight at a time, copied by a producer warp
// that does not wait for the kernel before. Why one at a time: the layer's next kernels stream their weights while
// this one's critical path (the input row's L2 round trip, the hand-off to the next kernel) runs, and a kernel's
// copies issued all at once (12 MB for Qwen3-0.6B's gate_up) slowed the hand-off beside them (kernel_phases.py,
// a one-off script in git history at 248c748: qkv -> attention 1.7-2.2 us, 0.5 now). bs=1 decode of Qwen3-0.6B
// on the H100, two CTAs a SM (window of chunks in
// flight / chunks): 1 / 3 1,415-1,419 tok/s, 1 / 4 1,403-1,409, 1 / 2 1,400-1,403, 1 / 6 1,387-1,391, 1 / 8
// 1,373-1,376, 2 / 4 1,368-1,370, 2 / 8 1,369-1,372; all at once by thread 0 (the kernel before, with gate_up's
// copies held 4 us) 1,369-1,371, all at once by the producer warp (gate_up held) 1,251-1,262. With the MLP's GEMVs
// at two CTAs a SM and the others at three (kernels/gemv_one_row.py): 1 / 4 1,468-1,469 and 1,494-1,495, 1 / 3
// 1,458-1,462 and 1,488-1,489 (two calls), 1 / 2 1,438. With the late launches below, the qkv GEMV (add_norm
// without SiLU behind; its CTAs now start ~1 us before their wait) in 3 chunks: 1,589 / 1,589 vs 1,575 / 1,580 in 4
// (1,593 vs 1,586 in another call), 1,564-1,567 in 2, 1,533-1,536 in 6.
constexpr int kChunks = 4;
constexpr int kBlock = kThreads + 32;  // the compute warps, then the producer warp

// Whether this GEMV lets the next kernel launch only after its own PDL wait (late) rather than at its start. The
// hardware places a launched kernel's CTAs wherever room appears, so a kernel launched early, while the SMs hold
// the layer's earlier kernels unevenly, piles up on the SMs that empty first: in a bs=1 Qwen3-0.6B step on the
// H100 (kernel_phases.py's stamps, at 248c748; 3 CTAs a SM intended) qkv's CTAs sat 1 to 9 to a SM, o's 1 to 8, down's
// 1 to 7, and a kernel's last CTA, which the next kernel waits for, was always on a crowded SM (a CTA's mean end
// after the wait grew ~300 ns for each CTA of its kernel beside it). Launched after the wait of the MLP's two
// GEMVs, down and the next layer's qkv find SMs holding one kernel's CTAs, evenly placed: decode 1,558-1,562 tok/s
// vs 1,491-1,492; late in gate_up alone or down alone: no change; in o or qkv (the ones whose next kernels stream
// the most while they wait): -8 to -10%. The MLP's GEMVs are those of kernels/gemv_one_row.py's ctas_per_sm: a
// stacked [gate; up] weight, or rows longer than 2048 (SHARE >= 3).
template <bool SILU_OUT, int SHARE>
constexpr bool kLaunchNextLate = SILU_OUT || SHARE >= 3;
constexpr int kMaxK = 4096;

enum Mode { MODE_PLAIN = 0, MODE_ADD_NORM = 1, MODE_SILU_MUL = 2, MODE_ADD_NORM_SILU_OUT = 3 };

template <int MODE, bool SILU_OUT>
constexpr int kChunksOf = MODE == MODE_ADD_NORM && !SILU_OUT ? 3 : kChunks;  // qkv_proj's: 3 (see kChunks)

// The producer thread's bulk copies of the CTA's slice of W, chunk c (of `chunks`) completing arrived[c], each
// issued once the one before has landed. With `second` (the up half of a stacked [gate; up] weight), the same rows
// of it land behind the first slice (at ws + stride * K).
template <typename T>
__device__ void stream_weight(T* ws, const T* slice, const T* second, int stride, int rows, int chunks, int K,
                              uint64_t* arrived) {
  for (int c = 0; c < chunks; ++c) {
    if (c > 0) barrier_wait(&arrived[c - 1], 0);
    const int r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
    const uint32_t bytes = static_cast<uint32_t>((r1 - r0) * K * sizeof(T));
    barrier_expect(&arrived[c], second != nullptr ? 2 * bytes : bytes);
    for (int part = 0; part < (second != nullptr ? 2 : 1); ++part) {
      const T* src = (part == 0 ? slice : second) + static_cast<size_t>(r0) * K;
      bulk_copy(ws + (static_cast<size_t>(part) * stride + r0) * K, src, bytes, &arrived[c]);
    }
  }
}

// a barrier of the compute warps only (the producer warp does not wait for the input row)
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

// Thread t's share of the input row: 16-byte vectors t, t + kThreads, ... (SHARE of them: K <= SHARE * 8 * kThreads).
// SHARE is a template parameter, the fewest for K (kMaxK / 8 / kThreads at most), rather than the most for every K:
// the unrolled code a layer's kernels run must stay in the SMs' instruction caches (see launch()).
// Rows that the kernels before wrote are read through L2 only (ld.global.cg): under PDL this kernel starts while
// they run, so this SM's L1 may still hold an older row at a reused address (seen on the H100: a graph of
// one-row GEMVs replayed with stale inputs when the reads went through L1's non-coherent path).
template <typename T, bool WRITTEN_BEFORE, int SHARE>
__device__ __forceinline__ void load_share(Pack<T> (&out)[SHARE], const T* row, int K) {
#pragma unroll
  for (int i = 0; i < SHARE; ++i) {
    const int v = threadIdx.x + kThreads * i;
    const uint4* src = reinterpret_cast<const uint4*>(row) + v;
    out[i].bits = v >= K / 8 ? make_uint4(0, 0, 0, 0) : WRITTEN_BEFORE ? __ldcg(src) : *src;
  }
}

// The input row after the fused operation, into xs (shared memory), each thread on its share: once per CTA, not
// once per warp (every warp redoing the SiLU of a 3072-long row cost microseconds), and through shared memory, so
// that a thread holds no copy of the row in registers (fewer registers: more CTAs of the next kernels fit beside).
template <typename T, int MODE, int SHARE>
__device__ void stage_input(T* xs, float* warp_squares, const Pack<T> (&scale)[SHARE], const T* x,
                            const T* residual, T* res_out, int K, float eps) {
  Pack<T> a[SHARE], b[SHARE];
  load_share<T, true, SHARE>(a, x, K);
  if constexpr (MODE == MODE_SILU_MUL) load_share<T, true, SHARE>(b, x + K, K);
  if constexpr (MODE == MODE_ADD_NORM)
    if (residual != nullptr) load_share<T, true, SHARE>(b, residual, K);
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < SHARE; ++i) {
    const int v = threadIdx.x + kThreads * i;
    if (v >= K / 8) break;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (MODE == MODE_SILU_MUL) {
        const float gate = to_float(a[i].v[e]);
        a[i].v[e] = from_float<T>(round_to<T>(gate / (1.f + expf(-gate))) * to_float(b[i].v[e]));
      } else if (MODE == MODE_ADD_NORM) {
        if (residual != nullptr) a[i].v[e] = from_float<T>(to_float(a[i].v[e]) + to_float(b[i].v[e]));
        squares += to_float(a[i].v[e]) * to_float(a[i].v[e]);
      }
    }
    if (MODE == MODE_ADD_NORM && res_out != nullptr) reinterpret_cast<uint4*>(res_out)[v] = a[i].bits;
    if (MODE != MODE_ADD_NORM) reinterpret_cast<uint4*>(xs)[v] = a[i].bits;
  }
  if constexpr (MODE == MODE_ADD_NORM) {
    const float inv = inv_rms<kWarps>(squares, warp_squares, [] { compute_sync(); }, K, eps);
    store_normed<T, SHARE, kThreads>(xs, a, scale, K, inv);
  }
  compute_sync();
}

template <typename T>
__device__ __forceinline__ float dot_row(const T* wrow, const T* xs, int K) {
  float acc = 0.f;
#pragma unroll 4
  for (int v = threadIdx.x % 32; v < K / 8; v += 32) {
    Pack<T> w, x;
    w.bits = reinterpret_cast<const uint4*>(wrow)[v];
    x.bits = reinterpret_cast<const uint4*>(xs)[v];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += to_float(w.v[e]) * to_float(x.v[e]);
  }
  return warp_sum(acc);
}

template <typename T, int MODE, bool SILU_OUT, int SHARE, int KC>
__global__ void __launch_bounds__(kBlock) gemv_one_row_kernel(
    const T* x, const T* __restrict__ w, const T* __restrict__ bias, T* y, const T* residual,
    const T* __restrict__ norm_w, T* res_out, int N, int k_arg, int rows_per_cta, float eps) {
  const int K = KC != 0 ? KC : k_arg;  // a constant where K is SHARE * 1024: no remainder code
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t arrived[kChunks];
  __shared__ float warp_squares[kWarps];
  constexpr int kParts = SILU_OUT ? 2 : 1;  // slices of W a CTA holds: its gate rows, then the same up rows
  const int outputs = N / kParts;
  T* ws = reinterpret_cast<T*>(smem);  // [kParts, rows_per_cta, K], then the fused input row [K]
  T* xs = ws + static_cast<size_t>(kParts) * rows_per_cta * K;
  const int row0 = blockIdx.x * rows_per_cta;
  const int rows = min(rows_per_cta, outputs - row0);
  const int chunks = min(rows, kChunksOf<MODE, SILU_OUT>);
  if (threadIdx.x == kThreads) {
    for (int c = 0; c < chunks; ++c) barrier_init(&arrived[c], 1);
    barriers_initialized();
  }
  __syncthreads();  // the barriers are initialized before any thread waits on them
  if (threadIdx.x >= kThreads) {  // the producer warp: its lane 0 streams W while the compute warps wait
    if constexpr (!kLaunchNextLate<SILU_OUT, SHARE>) launch_dependents();
    if (threadIdx.x == kThreads) {
      stream_weight(ws, w + static_cast<size_t>(row0) * K,
                    SILU_OUT ? w + static_cast<size_t>(outputs + row0) * K : nullptr, rows_per_cta, rows, chunks, K,
                    arrived);
    }
    return;
  }
  Pack<T> scale[SHARE];  // the norm's weight: read before the wait, like W
  if constexpr (MODE == MODE_ADD_NORM) load_share<T, false, SHARE>(scale, norm_w, K);
  if constexpr (kLaunchNextLate<SILU_OUT, SHARE>) {
    wait_for_prior_kernel();  // the input row is the kernel before's output
    launch_dependents();
  } else {
    release_then_wait();
  }
  stage_input<T, MODE, SHARE>(xs, warp_squares, scale, x, residual, blockIdx.x == 0 ? res_out : nullptr, K, eps);
  int ready = 0;  // chunks this warp has waited for
  for (int r = threadIdx.x / 32; r < rows; r += kWarps) {
    while (rows * ready / chunks <= r) barrier_wait(&arrived[ready++], 0);
    float acc = dot_row(ws + static_cast<size_t>(r) * K, xs, K);
    if (bias != nullptr) acc += to_float(bias[row0 + r]);
    if constexpr (SILU_OUT) {  // rounded as the unfused GEMV's output, then SiluAndMul
      float up = dot_row(ws + static_cast<size_t>(rows_per_cta + r) * K, xs, K);
      if (bias != nullptr) up += to_float(bias[outputs + row0 + r]);
      const float gate = round_to<T>(acc);
      acc = round_to<T>(gate / (1.f + expf(-gate))) * round_to<T>(up);
    }
    if (threadIdx.x % 32 == 0) y[row0 + r] = from_float<T>(acc);
  }
}

template <typename T, int MODE, bool SILU_OUT, int SHARE, int KC>
cudaError_t launch_kernel(const void* x, const void* w, const void* bias, void* y, const void* residual,
                          const void* norm_w, void* res_out, int N, int K, int rows_per_cta, float eps, int pdl,
                          cudaStream_t stream) {
  constexpr int kParts = SILU_OUT ? 2 : 1;
  const auto kernel = gemv_one_row_kernel<T, MODE, SILU_OUT, SHARE, KC>;
  const size_t smem = static_cast<size_t>(kParts * rows_per_cta + 1) * K * sizeof(T);
  static size_t smem_allowed = 0;  // raised once per instance, to the largest asked so far
  if (smem > smem_allowed) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    // all of the SM's shared memory rather than L1, so the next GEMVs' CTAs find room beside this one's
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (err != cudaSuccess) return err;
    smem_allowed = smem;
  }
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(dim3((N / kParts + rows_per_cta - 1) / rows_per_cta), dim3(kBlock),
                                                  smem, stream, attribute, pdl);
  return cudaLaunchKernelEx(&config, kernel, static_cast<const T*>(x), static_cast<const T*>(w),
                            static_cast<const T*>(bias), static_cast<T*>(y), static_cast<const T*>(residual),
                            static_cast<const T*>(norm_w), static_cast<T*>(res_out), N, K, rows_per_cta, eps);
}

// SHARE's instance with K the constant SHARE * 1024 where it is that, else with K as given.
template <typename T, int MODE, bool SILU_OUT, int SHARE>
cudaError_t launch_share(const void* x, const void* w, const void* bias, void* y, const void* residual,
                         const void* norm_w, void* res_out, int N, int K, int rows_per_cta, float eps, int pdl,
                         cudaStream_t stream) {
  return K == SHARE * 1024
      ? launch_kernel<T, MODE, SILU_OUT, SHARE, SHARE * 1024>(x, w, bias, y, residual, norm_w, res_out, N, K,
                                                              rows_per_cta, eps, pdl, stream)
      : launch_kernel<T, MODE, SILU_OUT, SHARE, 0>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta,
                                                   eps, pdl, stream);
}

// An instance per share of the input row a thread holds (K <= 1024, 2048, 3072, 4096), and one with K a constant
// where K is exactly that (Qwen3-0.6B's 1024 / 2048 / 3072): no code for other Ks, no remainder loops. A bs=1
// layer cycles through four of these kernels and a decode attention kernel, and alternating kernels pay for
// instruction fetch once their code outgrows the SM's cache (a microbenchmark, docs/design-notes.md: five 32 KB kernels in turn
// cost ~4.6 us a launch more than one). Qwen3-0.6B's layer runs 44 KB of GEMV code instead of 73 KB unrolled for
// K = 4096 everywhere: bs=1 decode on the H100 1,243 -> 1,275 tok/s with the share instances, -> 1,348 with the
// constant K (with the weights in L2 the share instances alone changed nothing, so fewer instructions on the
// critical path may count as much as their fetch).
template <typename T, int MODE, bool SILU_OUT = false>
cudaError_t launch(const void* x, const void* w, const void* bias, void* y, const void* residual,
                   const void* norm_w, void* res_out, int N, int K, int rows_per_cta, float eps, int pdl,
                   cudaStream_t stream) {
  if (K > kMaxK || K % 8 != 0) return cudaErrorInvalidValue;
  switch ((K / 8 + kThreads - 1) / kThreads) {
    case 1: return launch_share<T, MODE, SILU_OUT, 1>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl, stream);
    case 2: return launch_share<T, MODE, SILU_OUT, 2>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl, stream);
    case 3: return launch_share<T, MODE, SILU_OUT, 3>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl, stream);
    case 4: return launch_share<T, MODE, SILU_OUT, 4>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_for_mode(const void* x, const void* w, const void* bias, void* y, const void* residual,
                            const void* norm_w, void* res_out, int N, int K, int rows_per_cta, float eps, int mode,
                            int pdl, cudaStream_t stream) {
  switch (mode) {
    case MODE_PLAIN:
      return launch<T, MODE_PLAIN>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl, stream);
    case MODE_ADD_NORM:
      return launch<T, MODE_ADD_NORM>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl,
                                            stream);
    case MODE_SILU_MUL:
      return launch<T, MODE_SILU_MUL>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl,
                                            stream);
    case MODE_ADD_NORM_SILU_OUT:
      return launch<T, MODE_ADD_NORM, true>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, pdl,
                                            stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

// dtype: 0 bfloat16, 1 float16; K <= kMaxK, a multiple of 8; mode: a Mode (3: N even, rows_per_cta counting rows
// of each half). Pointers a mode does not use may be null; res_out null: the residual sum is not written. Returns
// a cudaError_t.
int nanovllm_gemv_one_row(int dtype, const void* x, const void* w, const void* bias, void* y, const void* residual,
                          const void* norm_w, void* res_out, int N, int K, int rows_per_cta, float eps, int mode,
                          int pdl, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0)
    return launch_for_mode<__nv_bfloat16>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, mode,
                                          pdl, s);
  return launch_for_mode<__half>(x, w, bias, y, residual, norm_w, res_out, N, K, rows_per_cta, eps, mode, pdl, s);
}

}  // extern "C"
