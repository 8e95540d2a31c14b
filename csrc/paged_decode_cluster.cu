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
// the caller sizes cap from max_model_len). After the wait the critical path has two CTA barriers and no
// cluster barrier: a warp a head row norms and rotates q (and the step's k) into shared memory; then each warp
// scores, softmaxes and sums V over its own run of positions with its own softmax state (warp shuffles only);
// the warps' states are combined and sent to the merging splits with st.async, which completes the receiver's
// mbarrier (on the H100 the combine, the pushes and a cluster.sync took ~1.9 us after the wait, the combine and
// the st.async sends ~0.7: the cluster.sync's release compiled to a GPU-wide fence).
// Rounded where the twins round: the q/k RMSNorm and rotary as kernels/rotary.py's rope_rows; the softmax
// weights rounded to the model dtype before they multiply V (the Triton kernel's tl.dot(p.to(v.dtype), v)).
// Reference: attention.torch_backend.decode_reference after RotaryEmbedding.forward_native
// (nanovllm/kernels/paged_decode_cluster.py).
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

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCap = 128;  // positions a CTA holds at once (paged_decode_cluster.py's MAX_CAP)
constexpr int kMaxPerWarp = kMaxCap / kWarps;

// How the work is laid out. Each warp owns a run of the CTA's positions and keeps its own softmax state, so no
// block-wide barrier separates scores, softmax and weighted sums (on the H100 the first version's block-wide
// steps, with a quarter of the threads busy, took ~6 us after the wait for 40 positions). For q.k a position
// takes kLanes lanes, each holding kLaneDims dimensions of q in registers: half in the first half of the head,
// half at the same offsets in the second, so each lane holds the rotary pairs (d, d + D/2) it rotates. For P.V
// every lane holds D/32 consecutive dimensions of the sums.
template <typename T, int D, int GROUP, int SPLITS>
struct Layout {
  static constexpr int kLaneDims = GROUP <= 2 ? 16 : (GROUP == 4 ? 8 : 4);  // at most 32 floats of q a lane
  static constexpr int kHalf = kLaneDims / 2;
  static constexpr int kLanes = D / kLaneDims;   // lanes a position
  static constexpr int kSlots = 32 / kLanes;     // positions a warp scores at once
  static constexpr int kPvDims = D / 32;
  static constexpr int kOwned = GROUP * D / SPLITS;  // outputs each split merges and writes
  static_assert(kLanes <= 32 && 32 % kLanes == 0 && SPLITS <= D && 32 % SPLITS == 0, "layout");
};

template <typename T, int D, int GROUP, int SPLITS>
struct Shared {
  using L = Layout<T, D, GROUP, SPLITS>;
  T cos[D], sin[D], q_norm[D], k_norm[D];  // at the new position; the norms' weights (ones without norms)
  T q[GROUP][D];  // the group's query heads, normed and rotated
  T k_new[D];     // the step's key (normed, rotated) and value, in the split that holds its position
  T v_new[D];
  float warp_p[kWarps][GROUP][kMaxPerWarp];  // each warp's scores, then its softmax weights
  float warp_m[kWarps][GROUP];               // each warp's softmax state: max and denominator
  float warp_l[kWarps][GROUP];
  // what every split of the cluster sends this split for its outputs: softmax state (max, denominator) and the
  // weighted sums of V
  float inbox_m[SPLITS][GROUP];
  float inbox_l[SPLITS][GROUP];
  float inbox_acc[SPLITS][L::kOwned];
  uint64_t inbox_full;  // completes when every split's sends have landed in this split's inbox
  static constexpr uint32_t kInboxBytes = SPLITS * (L::kOwned + 2 * GROUP) * sizeof(float);
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// v into the cluster peer `rank`'s copy of `field` (this CTA's shared memory address of it), completing 4 bytes of
// the peer's copy of `barrier` (st.async: no fence, no cluster barrier for the receiver to wait on)
__device__ __forceinline__ void send(const float* field, uint64_t* barrier, unsigned rank, float v) {
  uint32_t remote_field, remote_barrier;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_field) : "r"(smem_addr(field)), "r"(rank));
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_barrier) : "r"(smem_addr(barrier)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(remote_field), "r"(__float_as_uint(v)), "r"(remote_barrier) : "memory");
}

// log2 of the page size, a power of two (Config.block_size): shifts and masks instead of divisions by it
__device__ __forceinline__ int page_shift(const Params& p) { return __ffs(p.page) - 1; }

template <typename T, int N> __device__ __forceinline__ void load_shared(const T* p, float* out) {
  unpack<T, N>(*reinterpret_cast<const Piece<T, N>*>(p), out);
}

// K and V of positions [r0, r1) of one sequence and kv head into rows 0.. of ks and vs, except position `skip`
// (this step's, not in the cache yet). The block numbers are staged in `pages` first, so that no copy waits on
// a table read. Asynchronous: wait_copies() before reading the rows. UNROLL: 4 before the wait, where the copies
// must be issued fast; 1 for later rounds (off the common path: less code for the SM's instruction caches).
template <typename T, int D, int UNROLL>
__device__ void copy_rows(T* ks, T* vs, int* pages, const T* k_cache, const T* v_cache, const int* table,
                          const Params& p, int kv_head, int r0, int r1, int skip) {
  constexpr int kPieces = D / 8;  // 16-byte pieces of a row
  if (r1 <= r0) return;
  const int shift = page_shift(p), first_page = r0 >> shift;
  for (int i = threadIdx.x; i <= ((r1 - 1) >> shift) - first_page; i += kThreads) pages[i] = __ldcg(table + first_page + i);
  __syncthreads();
#pragma unroll UNROLL
  for (int i = threadIdx.x; i < (r1 - r0) * kPieces; i += kThreads) {
    const int r = i / kPieces, c = i % kPieces, pos = r0 + r;
    if (pos == skip) continue;
    const int64_t at = static_cast<int64_t>(pages[(pos >> shift) - first_page]) * p.stride_cb +
                       (pos & (p.page - 1)) * p.stride_cs + kv_head * p.stride_ch + c * 8;
    cp_async16(ks + r * D + c * 8, k_cache + at);
    cp_async16(vs + r * D + c * 8, v_cache + at);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <typename T, int D, int GROUP, int SPLITS>
__global__ void __launch_bounds__(kThreads) paged_decode_cluster_kernel(const Params p) {
  using L = Layout<T, D, GROUP, SPLITS>;
  using Sh = Shared<T, D, GROUP, SPLITS>;
  constexpr int H = L::kHalf;
  __shared__ __align__(16) Sh sh;
  extern __shared__ __align__(16) unsigned char smem[];
  // [cap, D] keys, [cap, D] values, [kWarps, GROUP, D] each warp's weighted sums, [cap + 1] block numbers
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + p.cap * D;
  float* warp_acc = reinterpret_cast<float*>(vs + p.cap * D);
  int* pages = reinterpret_cast<int*>(warp_acc + kWarps * GROUP * D);
  const int split = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = lane / L::kLanes, o = lane % L::kLanes;  // q.k: the lane's position in a pass, its dims
  T* k_cache = static_cast<T*>(p.k_cache);
  T* v_cache = static_cast<T*>(p.v_cache);
  const int* table = p.block_tables + seq * p.stride_bt;
  const int seq_len = __ldcg(p.seq_lens + seq), last = seq_len - 1;
  const int share = (seq_len + SPLITS - 1) / SPLITS;
  const int start = min(split * share, seq_len), end = min(start + share, seq_len);
  const bool holds_new = start <= last && last < end;
  const bool q_norm = p.q_norm_w != nullptr, k_norm = p.k_norm_w != nullptr;

  // Before the wait: nothing here reads what the kernel before writes.
  if (threadIdx.x == 0) {
    barrier_init(&sh.inbox_full, 1);
    barriers_initialized();
  }
  // every split's inbox barrier is initialized before any split sends (the cluster wait is below the copies)
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  copy_rows<T, D, 4>(ks, vs, pages, k_cache, v_cache, table, p, kv_head, start, min(end, start + p.cap), last);
  if (last >= 0) {
    const T* cos_row = static_cast<const T*>(p.cos) + static_cast<int64_t>(last) * D;
    const T* sin_row = static_cast<const T*>(p.sin) + static_cast<int64_t>(last) * D;
    for (int d = threadIdx.x; d < D; d += kThreads) {
      sh.cos[d] = cos_row[d], sh.sin[d] = sin_row[d];
      sh.q_norm[d] = q_norm ? static_cast<const T*>(p.q_norm_w)[d] : from_float<T>(1.f);
      sh.k_norm[d] = k_norm ? static_cast<const T*>(p.k_norm_w)[d] : from_float<T>(1.f);
    }
  }
  int64_t new_at = 0;  // where this step's key and value go in the caches
  if (holds_new) {
    const int64_t slot_new = __ldcg(p.slot_mapping + seq);
    new_at = (slot_new >> page_shift(p)) * p.stride_cb + (slot_new & (p.page - 1)) * p.stride_cs + kv_head * p.stride_ch;
  }
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  wait_copies();
  __syncthreads();
  wait_for_prior_kernel();  // q, k and v of this step are its output
  // The next kernel (the o GEMV) launches only now, not at this kernel's start: launched early, its CTAs piled
  // onto the SMs that emptied first (1 to 9 a SM where 3 were meant), and its last CTA, on a crowded SM, held the
  // layer (csrc/gemv_one_row.cu, kLaunchNextLate): bs=1 Qwen3-0.6B decode on the H100 1,580-1,582 tok/s vs 1,559-1,560.
  launch_dependents();

  // q and the step's k normed and rotated, a warp a head row (kRopeLanes lanes, 2 + 2 dims each), into shared
  // memory with the step's v; k and v also into the caches
  constexpr int kRopeLanes = D / 4;
  const int rows = GROUP + (holds_new ? 1 : 0);
  for (int row = warp; row < rows; row += kWarps) {
    const bool is_k = row == GROUP;
    const T* src = is_k ? static_cast<const T*>(p.k_new) + seq * p.stride_knt + kv_head * D
                        : static_cast<const T*>(p.q) + seq * p.stride_qt + (kv_head * GROUP + row) * p.stride_qh;
    const int ro = lane % kRopeLanes;
    float x[4];
    load_lane_dims<T, D, 2>(src, ro, x);
    Piece<T, 4> v{};
    if (is_k) v = load_global<T, 4>(static_cast<const T*>(p.v_new) + seq * p.stride_vnt + kv_head * D + ro * 4);
    norm_rotate<T, D, 2>(x, is_k ? k_norm : q_norm, is_k ? sh.k_norm : sh.q_norm, sh.cos, sh.sin, p.eps, ro);
    T* dst = is_k ? sh.k_new : sh.q[row];
    if (lane < kRopeLanes) {
      *reinterpret_cast<Piece<T, 2>*>(dst + ro * 2) = pack<T, 2>(x);
      *reinterpret_cast<Piece<T, 2>*>(dst + D / 2 + ro * 2) = pack<T, 2>(x + 2);
      if (is_k) {
        *reinterpret_cast<Piece<T, 2>*>(k_cache + new_at + ro * 2) = pack<T, 2>(x);
        *reinterpret_cast<Piece<T, 2>*>(k_cache + new_at + D / 2 + ro * 2) = pack<T, 2>(x + 2);
        *reinterpret_cast<Piece<T, 4>*>(sh.v_new + ro * 4) = v;
        *reinterpret_cast<Piece<T, 4>*>(v_cache + new_at + ro * 4) = v;
      }
    }
  }
  __syncthreads();
  float q[GROUP][L::kLaneDims];  // at this lane's dims (Layout)
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    load_shared<T, H>(sh.q[g] + o * H, q[g]);
    load_shared<T, H>(sh.q[g] + D / 2 + o * H, q[g] + H);
  }

  float m_run[GROUP], l_run[GROUP], acc[GROUP][L::kPvDims];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m_run[g] = -INFINITY, l_run[g] = 0.f;
#pragma unroll
    for (int e = 0; e < L::kPvDims; ++e) acc[g][e] = 0.f;
  }
  float (*wp)[kMaxPerWarp] = sh.warp_p[warp];

  for (int r0 = start; r0 < end; r0 += p.cap) {
    const int n = min(end - r0, p.cap);
    if (r0 != start) {  // a later round: its rows load after the wait
      __syncthreads();  // every warp is done with the previous round's rows
      copy_rows<T, D, 1>(ks, vs, pages, k_cache, v_cache, table, p, kv_head, r0, r0 + n, last);
      wait_copies();
      __syncthreads();
    }
    const int per_warp = (n + kWarps - 1) / kWarps;
    const int first = warp * per_warp, count = max(0, min(n - first, per_warp));  // this warp's rows

    // scores, kSlots positions at a time
    for (int i0 = 0; i0 < count; i0 += L::kSlots) {
      const int i = i0 + slot, r = first + i;
      float kx[L::kLaneDims];
      const bool valid = i < count;
      if (valid) {
        const T* key = r0 + r == last ? sh.k_new : ks + r * D;
        load_shared<T, H>(key + o * H, kx);
        load_shared<T, H>(key + D / 2 + o * H, kx + H);
      } else {
#pragma unroll
        for (int e = 0; e < L::kLaneDims; ++e) kx[e] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float s0 = 0.f, s1 = 0.f;  // two chains
#pragma unroll
        for (int e = 0; e < L::kLaneDims; e += 2) s0 += q[g][e] * kx[e], s1 += q[g][e + 1] * kx[e + 1];
        const float s = group_sum<L::kLanes>(s0 + s1) * p.scale;
        if (valid && o == 0) wp[g][i] = s;
      }
    }
    __syncwarp();
    // the warp's softmax state over its rows (lane i holds row i), merged with its earlier rounds'
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float s = lane < count ? wp[g][lane] : -INFINITY;
      const float m_new = fmaxf(m_run[g], warp_max(s));
      const float weight = lane < count ? __expf(s - m_new) : 0.f;
      if (lane < count) wp[g][lane] = round_to<T>(weight);  // as it multiplies V
      const float alpha = m_run[g] == -INFINITY ? 0.f : __expf(m_run[g] - m_new);
      l_run[g] = l_run[g] * alpha + warp_sum(weight);
      m_run[g] = m_new;
#pragma unroll
      for (int e = 0; e < L::kPvDims; ++e) acc[g][e] *= alpha;
    }
    __syncwarp();
    // weighted sums of V over the warp's rows, D / 32 dimensions a lane
    for (int i = 0; i < count; ++i) {
      const int r = first + i;
      float v[L::kPvDims];
      load_shared<T, L::kPvDims>((r0 + r == last ? sh.v_new : vs + r * D) + lane * L::kPvDims, v);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        const float weight = wp[g][i];
#pragma unroll
        for (int e = 0; e < L::kPvDims; ++e) acc[g][e] += weight * v[e];
      }
    }
  }

  // the warps' states into one for the CTA; each output goes to the split that merges it (its inbox, in that
  // CTA's shared memory), with this split's softmax state
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) sh.warp_m[warp][g] = m_run[g], sh.warp_l[warp][g] = l_run[g];
  }
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
#pragma unroll
    for (int e = 0; e < L::kPvDims; ++e) warp_acc[(warp * GROUP + g) * D + lane * L::kPvDims + e] = acc[g][e];
  __syncthreads();
  if (threadIdx.x == 0) barrier_expect(&sh.inbox_full, Sh::kInboxBytes);
  for (int item = threadIdx.x; item < GROUP * D; item += kThreads) {
    const int g = item / D, d = item % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sh.warp_m[w][g]);
    float sum = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float lw = sh.warp_l[w][g];
      const float weight = lw > 0.f ? __expf(sh.warp_m[w][g] - m) : 0.f;  // a warp with no rows weighs nothing
      sum += weight * warp_acc[(w * GROUP + g) * D + d];
      l += weight * lw;
    }
    send(&sh.inbox_acc[split][item % L::kOwned], &sh.inbox_full, item / L::kOwned, sum);
    if (d < SPLITS) {
      send(&sh.inbox_m[split][g], &sh.inbox_full, d, m);
      send(&sh.inbox_l[split][g], &sh.inbox_full, d, l);
    }
  }
  barrier_wait(&sh.inbox_full, 0);  // every split's sends have landed
  // merge: SPLITS lanes an output, one a split
  T* out = static_cast<T*>(p.out) + seq * p.stride_ot + kv_head * GROUP * p.stride_oh;
  for (int pair = threadIdx.x; pair < L::kOwned * SPLITS; pair += kThreads) {
    const int i = pair / SPLITS, s = pair % SPLITS;
    const int item = split * L::kOwned + i, g = item / D, d = item % D;
    const float m = sh.inbox_m[s][g], l = sh.inbox_l[s][g];
    const float m_max = group_max<SPLITS>(m);
    const float weight = l > 0.f ? __expf(m - m_max) : 0.f;  // an empty split weighs nothing
    const float num = group_sum<SPLITS>(weight * sh.inbox_acc[s][i]), den = group_sum<SPLITS>(weight * l);
    if (s == 0) out[g * p.stride_oh + d] = from_float<T>(den > 0.f ? num / den : 0.f);
  }
}

template <typename T, int D, int GROUP, int SPLITS>
cudaError_t launch(const Params& p, int kv_heads, int seqs, int pdl, cudaStream_t stream) {
  auto kernel = paged_decode_cluster_kernel<T, D, GROUP, SPLITS>;
  if (p.cap > kMaxCap) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(p.cap) * 2 * D * sizeof(T) + kWarps * GROUP * D * sizeof(float)
                      + (p.cap + 1) * sizeof(int);
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
