// Paged decode attention (one new token per sequence) for a few sequences, Hopper (sm_90) and newer.
//
// Why a CUDA kernel: at one sequence the Triton split-K decode kernel and its merge kernel took ~14 us of a
// ~33 us Qwen3-0.6B layer on the H100, for ~2.6 MB of keys and values. The cached keys and values do not depend
// on the kernel before (only this step's token does), so each CTA copies its share of the context into shared
// memory (cp.async) BEFORE the programmatic-dependent-launch wait, as the one-row GEMV does with its weight;
// after the wait only the new token's q, k and v (normed and rotated here; k and v stored to the cache here)
// and the arithmetic remain. The splits of one (sequence, kv head) are one thread-block cluster and merge their
// partial softmax states through distributed shared memory: no merge kernel, no partials in global memory.
//
// Grid (splits, kv heads, sequences), cluster (splits, 1, 1), 256 threads. Split s of a sequence of L tokens
// owns positions [s * ceil(L / splits), (s + 1) * ceil(L / splits)) up to L. A CTA holds `cap` positions of K
// and V at a time; a longer share is done in rounds, the later ones loaded after the wait (correct but slower:
// the caller sizes cap from max_model_len).
// Rounded where the twins round: the q/k RMSNorm and rotary as kernels/rotary.py's rope_rows; the softmax
// weights rounded to the model dtype before they multiply V (the Triton kernel's tl.dot(p.to(v.dtype), v)).
// Reference: attention.torch_backend.decode_reference after RotaryEmbedding.forward_native
// (nanovllm/kernels/paged_decode_cluster.py).
#include <cooperative_groups.h>

#include "common.cuh"

// The kernel's arguments: one struct, which the host fills through ctypes (nanovllm/kernels/paged_decode_cluster.py
// mirrors it field by field). Outside the anonymous namespace: the exported entry point takes it.
// Element strides; pointers a launch does not use are null (q_norm_w and k_norm_w: no q/k norms).
struct Params {
  const void* q;      // [B, H, D] rows of the step's queries, unrotated (strided views of a fused qkv are fine)
  const void* k_new;  // [B, kv_heads, D] the step's keys, unrotated; rows contiguous
  const void* v_new;  // [B, kv_heads, D] the step's values; rows contiguous
  void* k_cache;      // [blocks, page, kv_heads, D]
  void* v_cache;
  void* out;          // [B, H, D]
  const int* block_tables;     // [B, stride_bt]
  const int* seq_lens;         // [B], this token included
  const int64_t* slot_mapping;  // [B] the cache slot of this step's token
  const void* cos;    // [max_position, D] rotary tables in the model dtype
  const void* sin;
  const void* q_norm_w;  // [D] Qwen3's per-head RMSNorm weights, or null
  const void* k_norm_w;
  float eps, scale;
  int64_t stride_qt, stride_qh, stride_knt, stride_vnt, stride_ot, stride_oh;
  int64_t stride_cb, stride_cs, stride_ch, stride_bt;
  int page, cap;
};

namespace {

using namespace nanovllm;
namespace cg = cooperative_groups;

constexpr int kThreads = 256;  // two threads a position for the scores, four a pair of dimensions for the sums
constexpr int kWarps = kThreads / 32;

template <typename T, int D, int GROUP, int SPLITS>
struct Shared {
  static constexpr int kOwned = GROUP * D / SPLITS;  // outputs each split merges and writes
  T q[GROUP][D];    // this kv head's query heads, normed and rotated
  T k_new[D];       // the step's key (normed, rotated) and value, in the split that holds its position
  T v_new[D];
  float red_max[GROUP][kWarps];
  float red_sum[GROUP][kWarps];
  // what every split of the cluster sends this split for its outputs: softmax state (max, denominator) and the
  // weighted sums of V
  float inbox_m[SPLITS][GROUP];
  float inbox_l[SPLITS][GROUP];
  float inbox_acc[SPLITS][kOwned];
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Rows written by the kernels before are read through L2 only (see gemv_one_row.cu's load_share).
template <typename T> __device__ __forceinline__ float load_cg(const T* p) {
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return to_float(*reinterpret_cast<const T*>(&bits));
}

// K and V of positions [r0, r1) of one sequence and kv head into rows 0.. of ks and vs, except position `skip`
// (this step's, not in the cache yet). The block numbers are staged in `pages` first, so that no copy waits on
// a table read. Asynchronous: wait_copies() before reading the rows.
template <typename T, int D>
__device__ void copy_rows(T* ks, T* vs, int* pages, const T* k_cache, const T* v_cache, const int* table,
                          const Params& p, int kv_head, int r0, int r1, int skip) {
  constexpr int kPieces = D / 8;  // 16-byte pieces of a row
  if (r1 <= r0) return;
  const int first_page = r0 / p.page;
  for (int i = threadIdx.x; i <= (r1 - 1) / p.page - first_page; i += kThreads) pages[i] = __ldcg(table + first_page + i);
  __syncthreads();
#pragma unroll 4
  for (int i = threadIdx.x; i < (r1 - r0) * kPieces; i += kThreads) {
    const int r = i / kPieces, c = i % kPieces, pos = r0 + r;
    if (pos == skip) continue;
    const int64_t at = static_cast<int64_t>(pages[pos / p.page - first_page]) * p.stride_cb +
                       (pos % p.page) * p.stride_cs + kv_head * p.stride_ch + c * 8;
    cp_async16(ks + r * D + c * 8, k_cache + at);
    cp_async16(vs + r * D + c * 8, v_cache + at);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// What one lane needs to norm and rotate its E = D / 32 values of a head row at the new position (the rotary
// tables and norm weights are constant: read before the wait).
template <typename T, int D>
struct Rotation {
  static constexpr int E = D / 32;
  float cos[E], sin[E], w[E], w_partner[E];  // w: the norm's weight at the lane's values and their partners
  bool norm;

  __device__ void load(const Params& p, const void* norm_w, int pos) {
    const int d0 = (threadIdx.x % 32) * E, p0 = (d0 + D / 2) % D;
    norm = norm_w != nullptr;
    const T* cos_row = static_cast<const T*>(p.cos) + static_cast<int64_t>(pos) * D;
    const T* sin_row = static_cast<const T*>(p.sin) + static_cast<int64_t>(pos) * D;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      cos[e] = to_float(cos_row[d0 + e]);
      sin[e] = to_float(sin_row[d0 + e]);
      w[e] = norm ? to_float(static_cast<const T*>(norm_w)[d0 + e]) : 1.f;
      w_partner[e] = norm ? to_float(static_cast<const T*>(norm_w)[p0 + e]) : 1.f;
    }
  }

  // One warp: the head row src (written by the kernel before), normed and rotated, into dst (shared memory)
  // and, when given, into cache_dst (global).
  __device__ void apply(const T* src, float eps, T* dst, T* cache_dst) const {
    const int d0 = (threadIdx.x % 32) * E, p0 = (d0 + D / 2) % D;
    float a[E], b[E], squares = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      a[e] = load_cg(src + d0 + e);
      b[e] = load_cg(src + p0 + e);
      squares += a[e] * a[e];
    }
    if (norm) {
      const float inv_rms = 1.f / sqrtf(warp_sum(squares) / D + eps);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        a[e] = round_to<T>(round_to<T>(a[e] * inv_rms) * w[e]);
        b[e] = round_to<T>(round_to<T>(b[e] * inv_rms) * w_partner[e]);
      }
    }
    const float sign = d0 < D / 2 ? -1.f : 1.f;  // the first half takes -x2 * sin, the second +x1 * sin
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const T v = from_float<T>(round_to<T>(a[e] * cos[e]) + sign * round_to<T>(b[e] * sin[e]));
      dst[d0 + e] = v;
      if (cache_dst != nullptr) cache_dst[d0 + e] = v;
    }
  }
};

// Per query head of the group, the block-wide max (red = sh.red_max) or sum (sh.red_sum) of each thread's value.
template <int GROUP, bool MAX>
__device__ __forceinline__ void block_reduce(float (&v)[GROUP], float (&red)[GROUP][kWarps]) {
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const float w = MAX ? warp_max(v[g]) : warp_sum(v[g]);
    if (threadIdx.x % 32 == 0) red[g][threadIdx.x / 32] = w;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    v[g] = red[g][0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v[g] = MAX ? fmaxf(v[g], red[g][w]) : v[g] + red[g][w];
  }
}

template <typename T, int D, int GROUP, int SPLITS>
__global__ void __launch_bounds__(kThreads) paged_decode_cluster_kernel(const Params p) {
  using Sh = Shared<T, D, GROUP, SPLITS>;
  __shared__ __align__(16) Sh sh;
  extern __shared__ __align__(16) unsigned char smem[];
  // [cap, D] keys, [cap, D] values, [GROUP, cap] scores (then softmax weights), [kRowGroups, GROUP, D] sums,
  // [cap + 1] block numbers
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + p.cap * D;
  float* scores = reinterpret_cast<float*>(vs + p.cap * D);
  constexpr int kWords = D / 2;                   // a row as pairs of values
  constexpr int kRowGroups = kThreads / kWords;   // threads that share a pair of dimensions, over rows
  float* sums = scores + GROUP * p.cap;
  int* pages = reinterpret_cast<int*>(sums + kRowGroups * GROUP * D);
  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  const int* table = p.block_tables + seq * p.stride_bt;
  const int seq_len = __ldcg(p.seq_lens + seq), last = seq_len - 1;
  const int share = (seq_len + SPLITS - 1) / SPLITS;
  const int start = min(split * share, seq_len), end = min(start + share, seq_len);
  const bool holds_new = start <= last && last < end;

  launch_dependents();  // now: the next kernel's CTAs start their own loads beside this one's
  copy_rows<T, D>(ks, vs, pages, k_cache, v_cache, table, p, kv_head, start, min(end, start + p.cap), last);
  Rotation<T, D> q_rot, k_rot;
  if (last >= 0) {
    q_rot.load(p, p.q_norm_w, last);
    k_rot.load(p, p.k_norm_w, last);
  }
  int64_t new_at = 0;  // where this step's key and value go in the caches
  if (holds_new) {
    const int64_t slot = __ldcg(p.slot_mapping + seq);
    new_at = (slot / p.page) * p.stride_cb + (slot % p.page) * p.stride_cs + kv_head * p.stride_ch;
  }
  wait_for_prior_kernel();  // q, k and v of this step are its output

  const int warp = threadIdx.x / 32;
  const T* q = static_cast<const T*>(p.q) + seq * p.stride_qt + kv_head * GROUP * p.stride_qh;
  for (int row = warp; row < GROUP + (holds_new ? 1 : 0); row += kWarps) {
    if (row < GROUP)
      q_rot.apply(q + row * p.stride_qh, p.eps, sh.q[row], nullptr);
    else
      k_rot.apply(static_cast<const T*>(p.k_new) + seq * p.stride_knt + kv_head * D, p.eps, sh.k_new, k_cache + new_at);
  }
  if (holds_new) {
    const uint4* v_row = reinterpret_cast<const uint4*>(static_cast<const T*>(p.v_new) + seq * p.stride_vnt + kv_head * D);
    for (int c = threadIdx.x; c < D / 8; c += kThreads) {
      const uint4 v = __ldcg(v_row + c);
      reinterpret_cast<uint4*>(sh.v_new)[c] = v;
      reinterpret_cast<uint4*>(v_cache + new_at)[c] = v;
    }
  }
  wait_copies();
  __syncthreads();

  const int word = threadIdx.x % kWords, row_group = threadIdx.x / kWords;  // the sum of weighted values
  float m_run[GROUP], l_run[GROUP];
  float2 acc[GROUP];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) m_run[g] = -INFINITY, l_run[g] = 0.f, acc[g] = make_float2(0.f, 0.f);

  for (int r0 = start; r0 < end; r0 += p.cap) {
    const int n = min(end - r0, p.cap);
    if (r0 != start) {  // a later round: its rows load after the wait
      __syncthreads();  // every thread is done with the previous round's rows
      copy_rows<T, D>(ks, vs, pages, k_cache, v_cache, table, p, kv_head, r0, r0 + n, last);
      wait_copies();
      __syncthreads();
    }
    // scores: two threads a position, each on half of the row; word (j + lane) % kHalf of its half, so that a
    // warp's lanes hit distinct banks
    float m_new[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) m_new[g] = -INFINITY;
    constexpr int kHalf = kWords / 2;
    const int half = threadIdx.x % 2, lane = threadIdx.x % 32;
    for (int r_base = 0; r_base < n; r_base += kThreads / 2) {  // the same trip count in every thread: shuffles
      const int r = r_base + threadIdx.x / 2;
      float s[GROUP][2] = {};
      if (r < n) {
        const uint32_t* key = reinterpret_cast<const uint32_t*>(r0 + r == last ? sh.k_new : ks + r * D);
#pragma unroll 8
        for (int j = 0; j < kHalf; ++j) {
          const int w = half * kHalf + (j + lane) % kHalf;
          const float2 k2 = to_float2(key[w], T());
#pragma unroll
          for (int g = 0; g < GROUP; ++g) {
            const float2 q2 = to_float2(reinterpret_cast<const uint32_t*>(sh.q[g])[w], T());
            s[g][j % 2] += q2.x * k2.x + q2.y * k2.y;
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float score = s[g][0] + s[g][1];
        score = (score + __shfl_xor_sync(0xffffffffu, score, 1)) * p.scale;
        if (r < n) {
          if (half == 0) scores[g * p.cap + r] = score;
          m_new[g] = fmaxf(m_new[g], score);
        }
      }
    }
    block_reduce<GROUP, true>(m_new, sh.red_max);
    float l_new[GROUP] = {};
#pragma unroll
    for (int g = 0; g < GROUP; ++g) m_new[g] = fmaxf(m_new[g], m_run[g]);
    for (int r = threadIdx.x; r < n; r += kThreads) {
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float weight = expf(scores[g * p.cap + r] - m_new[g]);
        scores[g * p.cap + r] = round_to<T>(weight);  // as it multiplies V
        l_new[g] += weight;
      }
    }
    block_reduce<GROUP, false>(l_new, sh.red_sum);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float alpha = expf(m_run[g] - m_new[g]);
      acc[g].x *= alpha, acc[g].y *= alpha;
      l_run[g] = l_run[g] * alpha + l_new[g];
      m_run[g] = m_new[g];
    }
#pragma unroll 4
    for (int r = row_group; r < n; r += kRowGroups) {
      const T* value = r0 + r == last ? sh.v_new : vs + r * D;
      const float2 v2 = to_float2(reinterpret_cast<const uint32_t*>(value)[word], T());
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float weight = scores[g * p.cap + r];
        acc[g].x += weight * v2.x, acc[g].y += weight * v2.y;
      }
    }
  }

  // the row groups' sums, added per output; then each output goes to the split that merges it (its inbox, in
  // that CTA's shared memory), with this split's softmax state
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
    reinterpret_cast<float2*>(sums + (row_group * GROUP + g) * D)[word] = acc[g];
  __syncthreads();
  cg::cluster_group cluster = cg::this_cluster();
  for (int i = threadIdx.x; i < GROUP * D; i += kThreads) {
    float total = 0.f;
#pragma unroll
    for (int rg = 0; rg < kRowGroups; ++rg) total += sums[rg * GROUP * D + i];
    cluster.map_shared_rank(&sh, i / Sh::kOwned)->inbox_acc[split][i % Sh::kOwned] = total;
  }
  if (threadIdx.x < SPLITS) {
    Sh* peer = cluster.map_shared_rank(&sh, threadIdx.x);
#pragma unroll
    for (int g = 0; g < GROUP; ++g) peer->inbox_m[split][g] = m_run[g], peer->inbox_l[split][g] = l_run[g];
  }
  cluster.sync();  // every split's sends have landed
  T* out = static_cast<T*>(p.out) + seq * p.stride_ot + kv_head * GROUP * p.stride_oh;
  for (int i = threadIdx.x; i < Sh::kOwned; i += kThreads) {
    const int item = split * Sh::kOwned + i, g = item / D, d = item % D;
    float m_max = -INFINITY;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) m_max = fmaxf(m_max, sh.inbox_m[s][g]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int s = 0; s < SPLITS; ++s) {
      const float l = sh.inbox_l[s][g];
      const float weight = l > 0.f ? expf(sh.inbox_m[s][g] - m_max) : 0.f;  // an empty split weighs nothing
      num += weight * sh.inbox_acc[s][i];
      den += weight * l;
    }
    out[g * p.stride_oh + d] = from_float<T>(den > 0.f ? num / den : 0.f);
  }
}

template <typename T, int D, int GROUP, int SPLITS>
cudaError_t launch(const Params& p, int kv_heads, int seqs, int pdl, cudaStream_t stream) {
  auto kernel = paged_decode_cluster_kernel<T, D, GROUP, SPLITS>;
  constexpr int kRowGroups = kThreads / (D / 2);
  const size_t smem = static_cast<size_t>(p.cap) * (2 * D * sizeof(T) + GROUP * sizeof(float))
                      + kRowGroups * GROUP * D * sizeof(float) + (p.cap + 1) * sizeof(int);
  static size_t smem_allowed = 0;  // raised once per instance, to the largest asked so far
  if (smem > smem_allowed) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
    smem_allowed = smem;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(SPLITS, kv_heads, seqs);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = SPLITS;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1] = pdl_attribute();
  config.attrs = attributes;
  config.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

template <typename T, int D, int SPLITS>
cudaError_t launch_for_group(const Params& p, int group, int kv_heads, int seqs, int pdl, cudaStream_t s) {
  switch (group) {
    case 1: return launch<T, D, 1, SPLITS>(p, kv_heads, seqs, pdl, s);
    case 2: return launch<T, D, 2, SPLITS>(p, kv_heads, seqs, pdl, s);
    case 4: return launch<T, D, 4, SPLITS>(p, kv_heads, seqs, pdl, s);
    case 8: return launch<T, D, 8, SPLITS>(p, kv_heads, seqs, pdl, s);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_for_shape(const Params& p, int head_dim, int group, int splits, int kv_heads, int seqs, int pdl,
                             cudaStream_t s) {
  if (head_dim == 64 && splits == 8) return launch_for_group<T, 64, 8>(p, group, kv_heads, seqs, pdl, s);
  if (head_dim == 64 && splits == 16) return launch_for_group<T, 64, 16>(p, group, kv_heads, seqs, pdl, s);
  if (head_dim == 128 && splits == 8) return launch_for_group<T, 128, 8>(p, group, kv_heads, seqs, pdl, s);
  if (head_dim == 128 && splits == 16) return launch_for_group<T, 128, 16>(p, group, kv_heads, seqs, pdl, s);
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

// dtype: 0 bfloat16, 1 float16; head_dim 64 or 128; group (query heads per kv head) 1, 2, 4 or 8; splits (the
// cluster size) 8 or 16. Returns a cudaError_t.
int nanovllm_paged_decode_cluster(int dtype, const Params* p, int head_dim, int group, int splits, int kv_heads,
                                  int seqs, int pdl, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0) return launch_for_shape<__nv_bfloat16>(*p, head_dim, group, splits, kv_heads, seqs, pdl, s);
  return launch_for_shape<__half>(*p, head_dim, group, splits, kv_heads, seqs, pdl, s);
}

}  // extern "C"
