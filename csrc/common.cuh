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

}  // namespace nanovllm

extern "C" const char* nanovllm_cuda_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}
