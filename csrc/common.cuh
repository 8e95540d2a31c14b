// Helpers shared by the kernels of csrc/ (Hopper, sm_90): element conversions with the torch twins' rounding,
// 16-byte packs, warp sums, shared-memory addresses, and the error string that each library exports.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace nanovllm {

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
// v rounded to T and back, where the torch twin stores an intermediate in the model dtype
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_float(from_float<T>(v)); }

// two values of T in 4 bytes, as floats
__device__ __forceinline__ float2 to_float2(uint32_t bits, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
__device__ __forceinline__ float2 to_float2(uint32_t bits, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

// 8 values of T in 16 bytes
template <typename T> union Pack {
  uint4 bits;
  T v[8];
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbarriers in shared memory and the bulk async copies (TMA, no tensor map) that complete them
__device__ __forceinline__ void barrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// after the thread that initialized the barriers is done, before any other thread or copy uses them
__device__ __forceinline__ void barriers_initialized() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// an arrival that also expects `bytes` of copies to land before the phase completes
__device__ __forceinline__ void barrier_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// until the barrier's phase of this parity has completed
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  }
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// sum / max over aligned groups of N lanes (every lane of the warp calls it)
template <int N> __device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = N / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <int N> __device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int offset = N / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v); }
__device__ __forceinline__ float warp_max(float v) { return group_max<32>(v); }

// N consecutive values of T as one load or store: 4, 8 or 16 bytes
template <int BYTES> struct Bits;
template <> struct Bits<4> { using type = unsigned int; };
template <> struct Bits<8> { using type = uint2; };
template <> struct Bits<16> { using type = uint4; };
template <typename T, int N> using Piece = typename Bits<N * sizeof(T)>::type;

template <typename T, int N> union PieceValues {
  Piece<T, N> bits;
  uint32_t words[N / 2];
  T v[N];
};

template <typename T, int N> __device__ __forceinline__ void unpack(Piece<T, N> bits, float* out) {
  PieceValues<T, N> u;
  u.bits = bits;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = to_float2(u.words[i], T());
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}

template <typename T, int N> __device__ __forceinline__ Piece<T, N> pack(const float* in) {
  PieceValues<T, N> u;
#pragma unroll
  for (int i = 0; i < N; ++i) u.v[i] = from_float<T>(in[i]);
  return u.bits;
}

// Rows written by the kernels before are read through L2 only (see gemv_one_row.cu's load_share).
template <typename T, int N> __device__ __forceinline__ Piece<T, N> load_global(const T* p) {
  return __ldcg(reinterpret_cast<const Piece<T, N>*>(p));
}

// A head row's values at one lane's dimensions (Layout: x[e] at dim o * H + e, x[H + e] at D / 2 + o * H + e), in
// place: RMS-normed (when norm), then rotated. Rounded as kernels/rotary.py's rope_rows. The lane's group of
// D / (2 H) lanes holds the whole row.
template <typename T, int D, int H>
__device__ __forceinline__ void norm_rotate(float* x, bool norm, const T* norm_w, const T* cos, const T* sin,
                                            float eps, int o) {
  constexpr int kLanes = D / (2 * H);
  if (norm) {
    float squares = 0.f;
#pragma unroll
    for (int e = 0; e < 2 * H; ++e) squares += x[e] * x[e];
    const float inv_rms = 1.f / sqrtf(group_sum<kLanes>(squares) / D + eps);
#pragma unroll
    for (int e = 0; e < H; ++e) {
      x[e] = round_to<T>(round_to<T>(x[e] * inv_rms) * to_float(norm_w[o * H + e]));
      x[H + e] = round_to<T>(round_to<T>(x[H + e] * inv_rms) * to_float(norm_w[D / 2 + o * H + e]));
    }
  }
#pragma unroll
  for (int e = 0; e < H; ++e) {
    const int d1 = o * H + e, d2 = D / 2 + d1;
    const float a = x[e], b = x[H + e];
    x[e] = round_to<T>(round_to<T>(a * to_float(cos[d1])) - round_to<T>(b * to_float(sin[d1])));
    x[H + e] = round_to<T>(round_to<T>(b * to_float(cos[d2])) + round_to<T>(a * to_float(sin[d2])));
  }
}

// A lane's two pieces of a head row (global, written by the kernel before) as floats.
template <typename T, int D, int H> __device__ __forceinline__ void load_lane_dims(const T* row, int o, float* x) {
  unpack<T, H>(load_global<T, H>(row + o * H), x);
  unpack<T, H>(load_global<T, H>(row + D / 2 + o * H), x + H);
}

// 1 / RMS of a row of K from each thread's sum of squares: the warps' sums meet in warp_squares across `sync` (a
// barrier of the WARPS warps).
template <int WARPS, typename Sync>
__device__ __forceinline__ float inv_rms(float squares, float* warp_squares, Sync sync, int K, float eps) {
  squares = warp_sum(squares);
  if (threadIdx.x % 32 == 0) warp_squares[threadIdx.x / 32] = squares;
  sync();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += warp_squares[w];
  return rsqrtf(total / K + eps);
}

// A thread's packs of a row of K (packs threadIdx.x + i * STRIDE) normed as HF's RMSNorm rounds (the normed value
// in T, times the weight's packs in `scale`), into xs.
template <typename T, int N, int STRIDE>
__device__ __forceinline__ void store_normed(T* xs, Pack<T> (&x)[N], const Pack<T> (&scale)[N], int K, float inv_rms) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int v = threadIdx.x + STRIDE * i;
    if (v >= K / 8) break;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      x[i].v[e] = from_float<T>(to_float(scale[i].v[e]) * round_to<T>(to_float(x[i].v[e]) * inv_rms));
    reinterpret_cast<uint4*>(xs)[v] = x[i].bits;
  }
}

// Programmatic dependent launch: let the next kernel in the stream launch now (its CTAs start once every CTA of
// this one has said so, and still wait for this one to complete before they read what it writes).
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Wait until the kernel before has completed and its writes are visible. Everything before this call must not
// read what the kernel before writes.
__device__ __forceinline__ void wait_for_prior_kernel() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_then_wait() {
  launch_dependents();
  wait_for_prior_kernel();
}

// Launch attribute for programmatic dependent launch (unused when pdl is 0).
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}

// A launch of grid x block threads with smem bytes of dynamic shared memory, under programmatic dependent launch
// when pdl (`attribute` holds the launch attribute and must outlive the launch).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                        cudaLaunchAttribute& attribute, int pdl) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute = pdl_attribute();
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return config;
}

}  // namespace nanovllm

extern "C" const char* nanovllm_cuda_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}
