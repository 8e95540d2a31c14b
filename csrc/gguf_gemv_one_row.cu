// One-row GEMV (bs=1 decode) over GGUF 4-bit blocks kept in their file's fields (quant/gguf_weight.py: d, m or
// dmin, scales and qs each a tensor of rows): y = W x with fp16 x and y. The Triton GEMV spends its time turning
// nibbles into MMA operands; here a warp owns a row and each lane takes 16 quant bytes at a time (16 weights in the
// low nibbles, 16 in the high), makes exact fp16 integers q - 8 of nibble pairs with one bitwise op and a subtraction
// (0x6400 | q is 1024 + q), multiplies them by x in fp16 pairs (each half sums two products: |x| must stay under
// ~4000), and sums in fp32. The scales come in once a 16-weight group, in fp32: w = scale * (q - 8) + offset, so
// sum(w x) = scale * sum((q - 8) x) + offset * sum(x). Centred quants halve the products' rounding: the result is as
// close to the exact product as the dense fp16 path's (tests/test_gguf_gemv.py).
// Twin: F.linear(x, W.dequantize()) (gguf_formats).
#include "common.cuh"

using namespace nanovllm;

namespace {

enum Type { kQ4_0 = 0, kQ4_1 = 1, kQ4_K = 2, kINT4_G128 = 3 };  // INT4_G128: Q4_1's formula, 128 weights a block
constexpr int kWarps = 4;  // rows a CTA

struct GroupSums {
  float qx_low, x_low, qx_high, x_high;  // sum((q - 8) x) and sum(x) of the low nibbles' 16 weights, then the high's
};

__device__ __forceinline__ half2 as_half2(uint32_t bits) { return *reinterpret_cast<half2*>(&bits); }

// the nibbles q at bit `shift` of bytes 0 and 2 of w, as the fp16 integers q - 8
__device__ __forceinline__ half2 nibble_pair(uint32_t w, int shift) {
  return __hsub2(as_half2(((w >> shift) & 0x000F000Fu) | 0x64006400u), __float2half2_rn(1032.f));
}

// 16 quant bytes against the activations of their low nibbles (x_low[0..15]) and high nibbles (x_high[0..15])
__device__ __forceinline__ GroupSums dot_16_bytes(uint4 q, const __half* x_low, const __half* x_high) {
  uint4 xl[2] = {__ldg(reinterpret_cast<const uint4*>(x_low)), __ldg(reinterpret_cast<const uint4*>(x_low) + 1)};
  uint4 xh[2] = {__ldg(reinterpret_cast<const uint4*>(x_high)), __ldg(reinterpret_cast<const uint4*>(x_high) + 1)};
  const uint32_t* low = reinterpret_cast<const uint32_t*>(xl);  // half pairs (x[2j], x[2j+1])
  const uint32_t* high = reinterpret_cast<const uint32_t*>(xh);
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  GroupSums s = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bytes 4i..4i+3: weights 4i..4i+3 of each group
    const uint32_t w = words[i];
    const half2 l01 = as_half2(low[2 * i]), l23 = as_half2(low[2 * i + 1]);
    const half2 h01 = as_half2(high[2 * i]), h23 = as_half2(high[2 * i + 1]);
    // nibble_pair(w, 0) holds weights (4i, 4i+2), nibble_pair(w, 8) weights (4i+1, 4i+3)
    half2 p = __hmul2(nibble_pair(w, 0), __lows2half2(l01, l23));
    p = __hfma2(nibble_pair(w, 8), __highs2half2(l01, l23), p);
    float2 f = __half22float2(p);
    s.qx_low += f.x + f.y;
    p = __hmul2(nibble_pair(w, 4), __lows2half2(h01, h23));
    p = __hfma2(nibble_pair(w, 12), __highs2half2(h01, h23), p);
    f = __half22float2(p);
    s.qx_high += f.x + f.y;
    f = __half22float2(__hadd2(l01, l23));
    s.x_low += f.x + f.y;
    f = __half22float2(__hadd2(h01, h23));
    s.x_high += f.x + f.y;
  }
  return s;
}

// Q4_K's 6-bit scale and min of sub-block j from a super-block's 12 bytes
__device__ __forceinline__ float2 q4_k_scale_min(const uint8_t* s, int j) {
  if (j < 4) return make_float2(s[j] & 63, s[j + 4] & 63);
  return make_float2((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4));
}

template <int TYPE>
__global__ void __launch_bounds__(32 * kWarps) gguf_gemv_one_row_kernel(
    const __half* __restrict__ x, const __half* __restrict__ d, const __half* __restrict__ m,
    const uint8_t* __restrict__ scales, const uint8_t* __restrict__ qs, __half* __restrict__ y, int N, int K,
    int stride_d, int stride_scales, int stride_qs) {
  wait_for_prior_kernel();
  launch_dependents();
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  if (row >= N) return;
  const __half* d_row = d + static_cast<int64_t>(row) * stride_d;
  const __half* m_row = m + static_cast<int64_t>(row) * stride_d;
  const uint8_t* q_row = qs + static_cast<int64_t>(row) * stride_qs;
  float acc = 0.f;
#pragma unroll 2
  for (int u = lane; u < K / 32; u += 32) {  // unit u: 16 quant bytes, 32 weights
    if (TYPE == kQ4_K) {
      const int sb = u / 8, c = (u % 8) / 2, h = u % 2;  // super-block, 64-weight chunk, half of its bytes
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(q_row + sb * 128 + c * 32 + h * 16));
      const __half* xl = x + sb * 256 + c * 64 + h * 16;
      const GroupSums s = dot_16_bytes(q, xl, xl + 32);
      const uint8_t* sc = scales + static_cast<int64_t>(row) * stride_scales + sb * 12;
      const float2 low = q4_k_scale_min(sc, 2 * c), high = q4_k_scale_min(sc, 2 * c + 1);
      const float dd = __half2float(d_row[sb]), dmin = __half2float(m_row[sb]);  // w = dd * sc * q - dmin * mn
      acc += dd * (low.x * s.qx_low + high.x * s.qx_high) + (8.f * dd * low.x - dmin * low.y) * s.x_low
             + (8.f * dd * high.x - dmin * high.y) * s.x_high;
    } else if (TYPE == kINT4_G128) {
      const int b = u / 4, c = u % 4;  // block of 64 quant bytes, its 16-byte quarter
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(q_row + u * 16));
      const __half* xl = x + b * 128 + c * 16;
      const GroupSums s = dot_16_bytes(q, xl, xl + 64);
      const float dd = __half2float(d_row[b]);
      acc += dd * (s.qx_low + s.qx_high) + (8.f * dd + __half2float(m_row[b])) * (s.x_low + s.x_high);
    } else {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(q_row + u * 16));
      const GroupSums s = dot_16_bytes(q, x + u * 32, x + u * 32 + 16);
      const float dd = __half2float(d_row[u]);
      acc += dd * (s.qx_low + s.qx_high);  // Q4_0: w = dd * (q - 8)
      if (TYPE == kQ4_1) acc += (8.f * dd + __half2float(m_row[u])) * (s.x_low + s.x_high);  // w = dd * q + m
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) y[row] = __float2half_rn(acc);
}

template <int TYPE>
int launch(const void* x, const void* d, const void* m, const void* scales, const void* qs, void* y, int N, int K,
           int stride_d, int stride_scales, int stride_qs, int pdl, cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config = launch_config(dim3((N + kWarps - 1) / kWarps), dim3(32 * kWarps), 0, stream, attribute,
                                            pdl);
  return cudaLaunchKernelEx(&config, gguf_gemv_one_row_kernel<TYPE>, static_cast<const __half*>(x),
                            static_cast<const __half*>(d), static_cast<const __half*>(m),
                            static_cast<const uint8_t*>(scales), static_cast<const uint8_t*>(qs),
                            static_cast<__half*>(y), N, K, stride_d, stride_scales, stride_qs);
}

}  // namespace

extern "C" {

// type: 0 Q4_0, 1 Q4_1, 2 Q4_K, 3 INT4_G128; x, y fp16; K a multiple of 32 (256 for Q4_K, 128 for INT4_G128); x
// and qs rows 16-byte aligned; m is Q4_1's or INT4_G128's m or Q4_K's dmin (any pointer for Q4_0), scales Q4_K's (any pointer otherwise). Strides in elements of
// each field. Returns a cudaError_t.
int nanovllm_gguf_gemv_one_row(int type, const void* x, const void* d, const void* m, const void* scales,
                               const void* qs, void* y, int N, int K, int stride_d, int stride_scales, int stride_qs,
                               int pdl, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case kQ4_0: return launch<kQ4_0>(x, d, m, scales, qs, y, N, K, stride_d, stride_scales, stride_qs, pdl, s);
    case kQ4_1: return launch<kQ4_1>(x, d, m, scales, qs, y, N, K, stride_d, stride_scales, stride_qs, pdl, s);
    case kINT4_G128:
      return launch<kINT4_G128>(x, d, m, scales, qs, y, N, K, stride_d, stride_scales, stride_qs, pdl, s);
    default: return launch<kQ4_K>(x, d, m, scales, qs, y, N, K, stride_d, stride_scales, stride_qs, pdl, s);
  }
}

}  // extern "C"
