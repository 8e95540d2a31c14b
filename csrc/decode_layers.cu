// Every decoder layer of a one-sequence decode step (bs=1) in ONE persistent kernel, Hopper (sm_90) and newer.
//
// Why: at one sequence a Qwen3-0.6B step is a 0.9 GB weight stream cut into 28 x 5 dependent kernels. With one
// kernel each, a kernel's weight can only stream while its CTAs are resident, and they stay resident until the
// kernel before has finished: the weights of the next ~26 MB (the GPU's shared memory) stream while one kernel
// computes, then memory idles through each handoff (a layer took ~24.6 us on the H100 for a 10.5 us weight read).
// Here the weight stream never waits on the arithmetic: one CTA per SM, whose producer warp walks the CTA's share
// of every layer's weights in the order the arithmetic will use them and keeps a ring of `slots` 32 KB tiles in
// flight (bulk async copies); the consumer warps wait for their tile AND for the step before it (a counter in
// global memory that the CTAs of that step increment), then multiply on the tensor cores. Dependencies are
// counters, not kernel ends.
//
// Status: correct (tests/test_decode_layers.py) but slower than the kernel-by-kernel path on the H100 (Qwen3-0.6B:
// 1,085-1,103 vs 1,205-1,208 tok/s), so it runs only with NANOVLLM_DECODE_LAYERS=1. The stream is not the limit:
// each of a layer's 5 stages pays for its counter's release and the spin that sees it (~0.5 us), its input row's
// L2 round trip (~0.5 us) and its tiles, and attention ~6 us (docs/benchmarks.md, eleventh session).
//
// Work of one layer, in order (each stage waits for the whole stage before it, except where said):
//   QKV   rows of the fused qkv weight; input RMSNorm(hidden) with input_layernorm
//   ATTN  (kv head, split) tasks, one per CTA, positions [split * kCap, + kCap) of the context: the q heads of the
//         kv head (and the step's k in the split holding the new position) normed and rotated, k and v stored to
//         the cache, softmax(q K^T) V over the split; partial states to global memory; the last split of a kv
//         head to finish merges them (no extra stage). Keys and values of earlier positions are copied by the
//         producer before the layer starts (they do not depend on this step).
//   O     rows of o_proj; hidden += o (the residual add, rounded as the unfused path rounds)
//   GU    rows of gate and the same rows of up; input RMSNorm(hidden) with post_attention_layernorm; the output is
//         silu(gate) * up (what down_proj reads)
//   DOWN  rows of down_proj; hidden += down
// Tiles of a layer are numbered QKV, O, GU, DOWN and dealt round-robin to the CTAs continuing over the layers,
// so every CTA streams the same bytes per layer. The last CTA to finish zeroes the counters for the next launch.
// Rounded where the unfused kernels round (gemv_one_row.cu, paged_decode_cluster.cu). hidden is read and written
// in place: it is the residual stream; the model's final norm follows this kernel.
// Reference: the same model's layers run kernel by kernel (tests/test_decode_layers.py).
#include "common.cuh"

// One decoder layer's tensors; nanovllm/kernels/decode_layers.py mirrors the struct field by field.
struct LayerWeights {
  const void* qkv;       // [q_size + 2 kv_size, hidden]
  const void* qkv_bias;  // [q_size + 2 kv_size] or null
  const void* o;         // [hidden, heads * D]
  const void* o_bias;    // [hidden] or null
  const void* gate_up;   // [2 inter, hidden]: gate rows, then up rows
  const void* down;      // [hidden, inter]
  const void* input_norm;
  const void* post_norm;
  const void* q_norm;  // [D] Qwen3's per-head norms, or null
  const void* k_norm;
  void* k_cache;  // [blocks, page, kv_heads, D]
  void* v_cache;
};

struct Params {
  const LayerWeights* layers;  // [num_layers], device memory
  void* hidden;                // [hidden_size]: the embedding in, the residual stream after the last layer out
  void* qkv;                   // [q_size + 2 kv_size] scratch
  void* attn;                  // [heads * D] scratch
  void* act;                   // [inter] scratch
  float* partials;             // [kv_heads, splits, group, D + 2] scratch
  unsigned* counters;          // [num_layers * kStages + num_layers * kv_heads + 1], zero between launches
  const int* block_table;      // [max_blocks] of the sequence
  const int* seq_lens;         // [1], this token included
  const int64_t* slot_mapping;  // [1]
  const void* cos;             // [max_position, D] in the model dtype
  const void* sin;
  float eps, scale;
  int num_layers, hidden_size, heads, kv_heads, inter;
  int64_t stride_cb, stride_cs, stride_ch;  // cache strides (elements)
  int page, splits;                         // splits of each kv head: one CTA each
  int rows_qkv, rows_o, rows_gate_up, rows_down;  // rows a tile (gate_up: of each half)
  int slots;                                      // tiles in flight a CTA
  unsigned long long* stamps;  // null, or [CTAs, num_layers, 2, kStampEvents] globaltimer and clock64 stamps
                               // (scripts/decode_layers_phases.py)
};

namespace {

using namespace nanovllm;

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kTileBytes = 32 * 1024;            // a tile's rows at most (decode_layers.py: TILE_BYTES)
constexpr int kRowPad = 8;                       // elements after each row in shared memory: conflict-free MMA loads
constexpr int kSlotBytes = kTileBytes + 1024;    // + the padding of up to 64 rows (K >= 256)
constexpr int kMaxTileRows = 64;
constexpr int kCap = 64;  // context positions of one split (decode_layers.py: SPLIT_POSITIONS)
constexpr int kMaxGroup = 8;
constexpr int kMaxNormPacks = 4;  // 16-byte packs of the normed input a consumer holds: hidden_size <= 8192

enum Stage { QKV = 0, ATTN = 1, O = 2, GU = 3, DOWN = 4, kStages = 5 };

// Phase stamps (when Params.stamps is set): GEMV stage j (QKV, O, GU, DOWN = 0..3) at 4 j + {wait begins, the stage
// before has published, input staged, tiles done}; attention at kAttnStamp + {begins, qkv published, keys and
// values landed, partial written, counted, merged}; the producer at kProducerStamp + j (stage j's first tile
// issued) and kProducerStamp + 4 (keys and values issued); stage j's first tile landed at kTileStamp + j, done at
// kTileStamp + 4 + j.
constexpr int kStampEvents = 48, kAttnStamp = 16, kProducerStamp = 22, kTileStamp = 27;

__device__ __forceinline__ int stamp_stage(int stage) { return stage == QKV ? 0 : stage - 1; }

__device__ __forceinline__ void stamp(const Params& p, int layer, int event, bool who) {
  if (p.stamps != nullptr && who) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned long long* at = p.stamps + (static_cast<size_t>(blockIdx.x) * p.num_layers + layer) * 2 * kStampEvents;
    at[event] = t;
    at[kStampEvents + event] = clock64();  // exact within the SM (globaltimer may tick coarsely)
  }
}

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

// Consumers: until *counter >= target (the stage before has published), then its writes are visible: a relaxed
// spin, then one acquiring load (an acquire each turn would drop this SM's L1 each turn), as CUTLASS's barriers.
__device__ __forceinline__ void wait_count(const unsigned* counter, unsigned target) {
  if (threadIdx.x == 0) {
    unsigned seen;
    do {
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  }
  consumer_sync();
}

// Consumers: every consumer's writes before this call are visible to whoever sees *counter grow by n (the CTA
// barrier, then a releasing add: no full fence).
__device__ __forceinline__ void publish(unsigned* counter, unsigned n) {
  consumer_sync();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(n) : "memory");
}

// The value before adding 1, releasing this CTA's writes and acquiring those of the adds before it.
__device__ __forceinline__ unsigned count_in(unsigned* counter) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// The longest reduction, hidden (qkv, gate_up), heads * D (o) or inter (down): the staged input row's length.
template <int D> __host__ __device__ __forceinline__ int max_k(const Params& p) {
  return max(p.hidden_size, max(p.heads * D, p.inter));
}

// The CTA's plan: the layer's tile counts per stage and where each stage's tiles start in the layer's numbering.
template <int D> struct Plan {
  int tiles[kStages], offset[kStages], per_layer;
  int n[kStages], k[kStages], rows[kStages];

  __device__ void init(const Params& p) {
    const int q_size = p.heads * D, kv_size = p.kv_heads * D;
    n[QKV] = q_size + 2 * kv_size, k[QKV] = p.hidden_size, rows[QKV] = p.rows_qkv;
    n[O] = p.hidden_size, k[O] = q_size, rows[O] = p.rows_o;
    n[GU] = p.inter, k[GU] = p.hidden_size, rows[GU] = p.rows_gate_up;
    n[DOWN] = p.hidden_size, k[DOWN] = p.inter, rows[DOWN] = p.rows_down;
    n[ATTN] = k[ATTN] = rows[ATTN] = tiles[ATTN] = 0;
    per_layer = 0;
    for (int s = 0; s < kStages; ++s) {
      if (s != ATTN) tiles[s] = (n[s] + rows[s] - 1) / rows[s];
      offset[s] = per_layer;
      per_layer += tiles[s];
    }
  }

  // this CTA's first tile of the stage (tiles continue every gridDim.x)
  __device__ int first_tile(int layer, int stage) const {
    const long long base = static_cast<long long>(layer) * per_layer + offset[stage];
    return static_cast<int>((blockIdx.x - base % gridDim.x + gridDim.x) % gridDim.x);
  }
};

template <typename T> __device__ __forceinline__ const T* weight_of(const LayerWeights& lw, int stage) {
  return static_cast<const T*>(stage == QKV ? lw.qkv : stage == O ? lw.o : stage == GU ? lw.gate_up : lw.down);
}

// The CTA's attention task: (kv head, split), positions [start, end) of the context of `len` tokens.
struct Task {
  int kv_head, split, start, end, len;
  bool active, holds_new;
  __device__ Task(const Params& p, int len_) : len(len_) {
    const bool has = static_cast<int>(blockIdx.x) < p.kv_heads * p.splits;
    kv_head = blockIdx.x / p.splits, split = blockIdx.x % p.splits;
    start = split * kCap, end = min(len, start + kCap);
    active = has && start < len;
    holds_new = active && len - 1 < end;
  }
};

__device__ __forceinline__ int64_t cache_offset(const Params& p, int position, int kv_head) {
  const int64_t block = __ldcg(p.block_table + position / p.page);  // L2: this SM's L1 may hold last step's
  return block * p.stride_cb + (position % p.page) * p.stride_cs + kv_head * p.stride_ch;
}

struct Barriers {
  uint64_t full[16], empty[16];  // per ring slot
  uint64_t kv_full, kv_empty;
};

// ---- the producer warp --------------------------------------------------------------------------------------

// Keys and values of the task's positions except the new one (not in the cache yet) into ks / vs rows.
template <typename T, int D>
__device__ void produce_kv(const Params& p, const Task& task, const LayerWeights& lw, T* ks, T* vs, Barriers& b,
                           int layer) {
  const int lane = threadIdx.x % 32;
  if (layer > 0 && lane == 0) barrier_wait(&b.kv_empty, (layer - 1) & 1);
  const int old = (task.holds_new ? task.end - 1 : task.end) - task.start;
  if (lane == 0) barrier_expect(&b.kv_full, static_cast<uint32_t>(2 * old * D * sizeof(T)));
  __syncwarp();
  for (int r = lane; r < old; r += 32) {
    const int64_t at = cache_offset(p, task.start + r, task.kv_head);
    bulk_copy(ks + r * D, static_cast<const T*>(lw.k_cache) + at, D * sizeof(T), &b.kv_full);
    bulk_copy(vs + r * D, static_cast<const T*>(lw.v_cache) + at, D * sizeof(T), &b.kv_full);
  }
}

template <typename T, int D>
__device__ void produce(const Params& p, const Plan<D>& plan, const Task& task, const LayerWeights* layers,
                        unsigned char* ring, T* ks, T* vs, Barriers& b) {
  const int lane = threadIdx.x % 32;
  int seq = 0;  // tiles issued so far: the ring position
  for (int layer = 0; layer < p.num_layers; ++layer) {
    const LayerWeights& lw = layers[layer];
    for (int stage = 0; stage < kStages; ++stage) {
      if (stage == ATTN) {  // behind the QKV tiles: ~130 small copies ahead of them delayed the layer by ~1 us
        if (task.active) produce_kv<T, D>(p, task, lw, ks, vs, b, layer);
        stamp(p, layer, kProducerStamp + 4, lane == 0);
        continue;
      }
      const T* w = weight_of<T>(lw, stage);
      const int n = plan.n[stage], k = plan.k[stage], rows = plan.rows[stage];
      for (int t = plan.first_tile(layer, stage); t < plan.tiles[stage]; t += gridDim.x, ++seq) {
        const int slot = seq % p.slots, use = seq / p.slots, parts = stage == GU ? 2 : 1;
        const int row0 = t * rows, count = min(rows, n - row0);
        const uint32_t row_bytes = static_cast<uint32_t>(k) * sizeof(T);
        if (lane == 0) {
          if (t == plan.first_tile(layer, stage)) stamp(p, layer, kProducerStamp + stamp_stage(stage), true);
          if (use > 0) barrier_wait(&b.empty[slot], (use - 1) & 1);
          barrier_expect(&b.full[slot], parts * count * row_bytes);
        }
        __syncwarp();
        T* dst = reinterpret_cast<T*>(ring + static_cast<size_t>(slot) * kSlotBytes);
        for (int i = lane; i < parts * count; i += 32) {  // a row a copy, at the padded stride
          const int part = i / count, r = i % count;
          bulk_copy(dst + static_cast<size_t>(i) * (k + kRowPad), w + static_cast<size_t>(part * n + row0 + r) * k,
                    row_bytes, &b.full[slot]);
        }
      }
    }
  }
}

// ---- the consumer warps -------------------------------------------------------------------------------------

// Thread's packs of a norm weight (QKV, GU), read before the wait: it does not depend on the step.
template <typename T>
__device__ __forceinline__ void load_norm(Pack<T> (&scale)[kMaxNormPacks], const T* norm, int k) {
#pragma unroll
  for (int i = 0; i < kMaxNormPacks; ++i) {
    const int v = threadIdx.x + i * kConsumers;
    scale[i].bits = v < k / 8 ? __ldg(reinterpret_cast<const uint4*>(norm) + v) : make_uint4(0, 0, 0, 0);
  }
}

// The stage's input row into xs: RMSNorm(hidden) * norm for QKV and GU, attn or act as they are for O and DOWN.
template <typename T>
__device__ void stage_input(const Params& p, int stage, int k, T* xs, float* squares,
                            const Pack<T> (&scale)[kMaxNormPacks]) {
  const int packs = k / 8;
  if (stage == O || stage == DOWN) {
    const uint4* src = static_cast<const uint4*>(stage == O ? p.attn : p.act);
    for (int v = threadIdx.x; v < packs; v += kConsumers) reinterpret_cast<uint4*>(xs)[v] = __ldcg(src + v);
    consumer_sync();
    return;
  }
  const uint4* src = static_cast<const uint4*>(p.hidden);
  Pack<T> x[kMaxNormPacks];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxNormPacks; ++i) {
    const int v = threadIdx.x + i * kConsumers;
    x[i].bits = v < packs ? __ldcg(src + v) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += to_float(x[i].v[e]) * to_float(x[i].v[e]);
  }
  const float inv = inv_rms<kConsumerWarps>(sum, squares, [] { consumer_sync(); }, k, p.eps);
  store_normed<T, kMaxNormPacks, kConsumers>(xs, x, scale, k, inv);
  consumer_sync();
}

// What an output adds to the product: the bias (QKV, O), the residual stream's value (O, DOWN: it is final once the
// stage's input is, and is read before the product so that its latency hides behind it).
template <typename T>
__device__ __forceinline__ float2 addends(const Params& p, const LayerWeights& lw, int stage, int row) {
  const T* bias = static_cast<const T*>(stage == QKV ? lw.qkv_bias : stage == O ? lw.o_bias : nullptr);
  const float h = stage == O || stage == DOWN ? to_float(__ldcg(static_cast<const T*>(p.hidden) + row)) : 0.f;
  return make_float2(bias != nullptr ? to_float(bias[row]) : 0.f, h);
}

// One output of a GEMV stage, rounded as the unfused kernels round.
template <typename T>
__device__ __forceinline__ void write_output(const Params& p, int stage, int row, float y, float up, float2 add) {
  if (stage == QKV) {
    static_cast<T*>(p.qkv)[row] = from_float<T>(y + add.x);
  } else if (stage == GU) {
    const float gate = round_to<T>(y);
    static_cast<T*>(p.act)[row] = from_float<T>(round_to<T>(gate / (1.f + expf(-gate))) * round_to<T>(up));
  } else {  // O, DOWN: the residual add
    __stcg(static_cast<T*>(p.hidden) + row, from_float<T>(add.y + round_to<T>(y + add.x)));
  }
}

// D += A B for one m16n8k16 tile: A 16 x 16 (rows of W), B 16 x 8 (the input, in every column), fp32 sums.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One weight tile on the tensor cores: its rows (gate rows, then up rows for GU) in blocks of 16 as A, the input
// row as every column of B; warp w takes the k-steps w, w + 8, ...; the warps' sums meet in shared memory. A
// pack of 8 on the CUDA cores costs 26 instructions (loads, 16 conversions, 8 FMAs): a 32 KB tile ~0.48 us of issue
// on one SM, and the step ran 1,033 tok/s that way against 1,086 on the tensor cores (Qwen3-0.6B, H100); here a 16 x
// 16 block is 6 loads and one MMA.
template <typename T>
__device__ void consume_tile(const Params& p, const LayerWeights& lw, int stage, int n, int k, int rows, int t,
                             const T* ws, const T* xs, uint64_t* empty, float (*sums)[kMaxTileRows]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int row0 = t * rows, count = min(rows, n - row0), total = (stage == GU ? 2 : 1) * count;
  const bool writes = static_cast<int>(threadIdx.x) < count;
  const float2 add = writes ? addends<T>(p, lw, stage, row0 + threadIdx.x) : make_float2(0.f, 0.f);
  const uint32_t* x = reinterpret_cast<const uint32_t*>(xs);
  const int ld = (k + kRowPad) / 2;  // words a row
  for (int block = 0; block * 16 < total; ++block) {
    const uint32_t* lo = reinterpret_cast<const uint32_t*>(ws) + min(block * 16 + group, total - 1) * ld + quad;
    const uint32_t* hi = reinterpret_cast<const uint32_t*>(ws) + min(block * 16 + group + 8, total - 1) * ld + quad;
    float c[4] = {};
#pragma unroll 4
    for (int step = warp; step < k / 16; step += kConsumerWarps) {
      const int at = step * 8;
      const uint32_t a[4] = {lo[at], hi[at], lo[at + 4], hi[at + 4]};
      const uint32_t b[2] = {x[at + quad], x[at + quad + 4]};
      mma(c, a, b, T());
    }
    if (quad == 0) sums[warp][block * 16 + group] = c[0], sums[warp][block * 16 + group + 8] = c[2];
  }
  __syncwarp();
  if (lane == 0) barrier_arrive(empty);
  consumer_sync();
  if (writes) {
    float y = 0.f, up = 0.f;
#pragma unroll
    for (int w = 0; w < kConsumerWarps; ++w) {
      y += sums[w][threadIdx.x];
      if (stage == GU) up += sums[w][count + threadIdx.x];
    }
    write_output<T>(p, stage, row0 + threadIdx.x, y, up, add);
  }
}

// Shared memory of the consumers besides the ring and the keys / values.
struct ConsumerShared {
  float q[kMaxGroup * 128];        // the group's queries, normed and rotated
  float weights[kMaxGroup][kCap];  // scores, then softmax weights
  float m[kMaxGroup], l[kMaxGroup];
  float squares[kConsumerWarps];
  float sums[2][kConsumerWarps][kMaxTileRows];  // the MMA tiles' per-warp sums, by tile parity
  uint16_t rope[4][128];  // cos, sin at the new position; q and k norm weights (ones without norms), as T
  int last;
};

// The task's split of attention for one layer; the last split of its kv head to finish merges all of them.
template <typename T, int D>
__device__ void attend(const Params& p, const Plan<D>& plan, const Task task, const LayerWeights& lw, int layer,
                       T* ks, T* vs, Barriers& b, ConsumerShared& sh) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.heads / p.kv_heads, last = task.len - 1;
  const T* qkv = static_cast<const T*>(p.qkv);
  const bool t0 = threadIdx.x == 0;
  stamp(p, layer, kAttnStamp, t0);
  T(*rope)[128] = reinterpret_cast<T(*)[128]>(sh.rope);  // before the wait: none of it depends on the step
  const bool norms = lw.q_norm != nullptr;
  for (int d = threadIdx.x; d < D; d += kConsumers) {
    rope[0][d] = static_cast<const T*>(p.cos)[static_cast<int64_t>(last) * D + d];
    rope[1][d] = static_cast<const T*>(p.sin)[static_cast<int64_t>(last) * D + d];
    rope[2][d] = norms ? static_cast<const T*>(lw.q_norm)[d] : from_float<T>(1.f);
    rope[3][d] = norms ? static_cast<const T*>(lw.k_norm)[d] : from_float<T>(1.f);
  }
  wait_count(p.counters + layer * kStages + QKV, plan.tiles[QKV]);  // and the tables are in place
  stamp(p, layer, kAttnStamp + 1, t0);
  // q heads (and the step's k): a warp a head row; rounded as rotary's twin. k and v also into the cache.
  constexpr int kRopeLanes = D / 4;
  const int ro = lane % kRopeLanes;
  for (int row = warp; row < group + (task.holds_new ? 1 : 0); row += kConsumerWarps) {
    const bool is_k = row == group;
    const T* src = qkv + (is_k ? (p.heads + task.kv_head) * D : (task.kv_head * group + row) * D);
    float x[4];
    load_lane_dims<T, D, 2>(src, ro, x);
    norm_rotate<T, D, 2>(x, norms, rope[is_k ? 3 : 2], rope[0], rope[1], p.eps, ro);
    if (lane >= kRopeLanes) continue;
    if (!is_k) {
      float* q = sh.q + row * D;
      q[ro * 2] = x[0], q[ro * 2 + 1] = x[1], q[D / 2 + ro * 2] = x[2], q[D / 2 + ro * 2 + 1] = x[3];
      continue;
    }
    const int r = last - task.start;
    const int64_t slot = __ldcg(p.slot_mapping);
    const int64_t at = (slot / p.page) * p.stride_cb + (slot % p.page) * p.stride_cs + task.kv_head * p.stride_ch;
    const Piece<T, 2> k_lo = pack<T, 2>(x), k_hi = pack<T, 2>(x + 2);
    const Piece<T, 4> v = load_global<T, 4>(qkv + (p.heads + p.kv_heads + task.kv_head) * D + ro * 4);
    T* k_cache = static_cast<T*>(lw.k_cache) + at;
    T* v_cache = static_cast<T*>(lw.v_cache) + at;
    *reinterpret_cast<Piece<T, 2>*>(ks + r * D + ro * 2) = k_lo;
    *reinterpret_cast<Piece<T, 2>*>(ks + r * D + D / 2 + ro * 2) = k_hi;
    *reinterpret_cast<Piece<T, 4>*>(vs + r * D + ro * 4) = v;
    *reinterpret_cast<Piece<T, 2>*>(k_cache + ro * 2) = k_lo;
    *reinterpret_cast<Piece<T, 2>*>(k_cache + D / 2 + ro * 2) = k_hi;
    *reinterpret_cast<Piece<T, 4>*>(v_cache + ro * 4) = v;
  }
  barrier_wait(&b.kv_full, layer & 1);
  consumer_sync();
  stamp(p, layer, kAttnStamp + 2, t0);
  // scores: 8 lanes a position, D / 8 dimensions each
  constexpr int kDims = D / 8;
  const int n = task.end - task.start, o = lane % 8;
  for (int j0 = 0; j0 < n; j0 += kConsumers / 8) {
    const int j = j0 + threadIdx.x / 8;
    float kx[kDims];
    if (j < n) {
#pragma unroll
      for (int e = 0; e < kDims; e += 8)
        unpack<T, 8>(*reinterpret_cast<const uint4*>(ks + j * D + o * kDims + e), kx + e);
    } else {
#pragma unroll
      for (int e = 0; e < kDims; ++e) kx[e] = 0.f;
    }
    for (int g = 0; g < group; ++g) {
      const float* q = sh.q + g * D + o * kDims;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int e = 0; e < kDims; e += 2) s0 += q[e] * kx[e], s1 += q[e + 1] * kx[e + 1];
      const float s = group_sum<8>(s0 + s1) * p.scale;
      if (j < n && o == 0) sh.weights[g][j] = s;
    }
  }
  consumer_sync();
  // softmax over the split: a warp a head
  for (int g = warp; g < group; g += kConsumerWarps) {
    const float s0 = lane < n ? sh.weights[g][lane] : -INFINITY;
    const float s1 = lane + 32 < n ? sh.weights[g][lane + 32] : -INFINITY;
    const float m = warp_max(fmaxf(s0, s1));
    const float e0 = lane < n ? __expf(s0 - m) : 0.f, e1 = lane + 32 < n ? __expf(s1 - m) : 0.f;
    const float l = warp_sum(e0 + e1);
    if (lane < n) sh.weights[g][lane] = round_to<T>(e0);  // as they multiply V
    if (lane + 32 < n) sh.weights[g][lane + 32] = round_to<T>(e1);
    if (lane == 0) sh.m[g] = m, sh.l[g] = l;
  }
  consumer_sync();
  // weighted sums of V: a thread an output, into this split's partial state
  float* partials = p.partials + static_cast<size_t>(task.kv_head * p.splits + task.split) * group * (D + 2);
  for (int item = threadIdx.x; item < group * D; item += kConsumers) {
    const int g = item / D, d = item % D;
    float acc[4] = {};
#pragma unroll 8
    for (int j = 0; j < n; ++j) acc[j % 4] += sh.weights[g][j] * to_float(vs[j * D + d]);
    __stcg(partials + g * (D + 2) + d, (acc[0] + acc[1]) + (acc[2] + acc[3]));
    if (d == 0) __stcg(partials + g * (D + 2) + D, sh.m[g]), __stcg(partials + g * (D + 2) + D + 1, sh.l[g]);
  }
  consumer_sync();
  stamp(p, layer, kAttnStamp + 3, t0);
  const int active_splits = (task.len + kCap - 1) / kCap;
  if (threadIdx.x == 0) {
    barrier_arrive(&b.kv_empty);
    sh.last = count_in(p.counters + p.num_layers * kStages + layer * p.kv_heads + task.kv_head) ==
              static_cast<unsigned>(active_splits - 1);
  }
  consumer_sync();
  stamp(p, layer, kAttnStamp + 4, t0);
  if (!sh.last) return;
  // the merge: every split's state for each output of the kv head's q heads
  const float* head_partials = p.partials + static_cast<size_t>(task.kv_head * p.splits) * group * (D + 2);
  for (int item = threadIdx.x; item < group * D; item += kConsumers) {
    const int g = item / D, d = item % D;
    float m = -INFINITY, num = 0.f, den = 0.f;  // one pass, rescaled as the maximum grows
#pragma unroll 4
    for (int s = 0; s < active_splits; ++s) {
      const float* part = head_partials + (s * group + g) * (D + 2);
      const float m_s = __ldcg(part + D), l_s = __ldcg(part + D + 1), acc_s = __ldcg(part + d);
      const float m_new = fmaxf(m, m_s), old = __expf(m - m_new), weight = __expf(m_s - m_new);
      num = num * old + weight * acc_s, den = den * old + weight * l_s, m = m_new;
    }
    static_cast<T*>(p.attn)[(task.kv_head * group + g) * D + d] = from_float<T>(num / den);
  }
  publish(p.counters + layer * kStages + ATTN, 1);
  stamp(p, layer, kAttnStamp + 5, t0);
}

template <typename T, int D>
__device__ void consume(const Params& p, const Plan<D>& plan, const Task& task, const LayerWeights* layers,
                        unsigned char* ring, T* ks, T* vs, T* xs, Barriers& b, ConsumerShared& sh) {
  int seq = 0;
  for (int layer = 0; layer < p.num_layers; ++layer) {
    const LayerWeights& lw = layers[layer];
    for (int stage = 0; stage < kStages; ++stage) {
      if (stage == ATTN) {
        if (task.active) attend<T, D>(p, plan, task, lw, layer, ks, vs, b, sh);
        continue;
      }
      int t = plan.first_tile(layer, stage);
      if (t >= plan.tiles[stage]) continue;
      const int event = 4 * stamp_stage(stage);
      stamp(p, layer, event, threadIdx.x == 0);
      Pack<T> scale[kMaxNormPacks];
      if (stage == QKV || stage == GU)
        load_norm<T>(scale, static_cast<const T*>(stage == QKV ? lw.input_norm : lw.post_norm), plan.k[stage]);
      if (stage == QKV && layer > 0) wait_count(p.counters + (layer - 1) * kStages + DOWN, plan.tiles[DOWN]);
      if (stage == O) wait_count(p.counters + layer * kStages + ATTN, p.kv_heads);
      if (stage == GU) wait_count(p.counters + layer * kStages + O, plan.tiles[O]);
      if (stage == DOWN) wait_count(p.counters + layer * kStages + GU, plan.tiles[GU]);
      stamp(p, layer, event + 1, threadIdx.x == 0);
      stage_input<T>(p, stage, plan.k[stage], xs, sh.squares, scale);
      stamp(p, layer, event + 2, threadIdx.x == 0);
      unsigned done = 0;
      for (; t < plan.tiles[stage]; t += gridDim.x, ++seq, ++done) {
        const int slot = seq % p.slots;
        barrier_wait(&b.full[slot], (seq / p.slots) & 1);
        stamp(p, layer, kTileStamp + stamp_stage(stage), threadIdx.x == 0 && done == 0);
        const T* ws = reinterpret_cast<const T*>(ring + static_cast<size_t>(slot) * kSlotBytes);
        consume_tile<T>(p, lw, stage, plan.n[stage], plan.k[stage], plan.rows[stage], t, ws, xs, &b.empty[slot],
                        sh.sums[seq & 1]);
        stamp(p, layer, kTileStamp + 4 + stamp_stage(stage), threadIdx.x == 0 && done == 0);
      }
      publish(p.counters + layer * kStages + stage, done);
      stamp(p, layer, event + 3, threadIdx.x == 0);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) decode_layers_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ Barriers barriers;
  __shared__ ConsumerShared sh;
  unsigned char* ring = smem;
  T* ks = reinterpret_cast<T*>(ring + static_cast<size_t>(p.slots) * kSlotBytes);
  T* vs = ks + kCap * D;
  T* xs = vs + kCap * D;
  // the plan and the layers' pointers in shared memory: after each wait the consumers' L1 is dropped (the acquiring
  // fence), and reading them from global or local memory there put an L2 round trip into every tile. (The plan in
  // shared memory also lets the stage loop stay rolled: 10K SASS lines instead of 15K, at the same speed.)
  __shared__ Plan<D> plan;
  if (threadIdx.x == 0) plan.init(p);
  LayerWeights* layers = reinterpret_cast<LayerWeights*>(xs + max_k<D>(p));
  for (int i = threadIdx.x; i < p.num_layers * static_cast<int>(sizeof(LayerWeights) / 8); i += kThreads)
    reinterpret_cast<uint64_t*>(layers)[i] = reinterpret_cast<const uint64_t*>(p.layers)[i];
  const Task task(p, __ldcg(p.seq_lens));
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.slots; ++s)
      barrier_init(&barriers.full[s], 1), barrier_init(&barriers.empty[s], kConsumerWarps);
    barrier_init(&barriers.kv_full, 1);
    barrier_init(&barriers.kv_empty, 1);
    barriers_initialized();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {  // the producer: weights and cached keys / values only, before any wait
    produce<T, D>(p, plan, task, layers, ring, ks, vs, barriers);
    return;
  }
  wait_for_prior_kernel();  // hidden is the embedding kernel's output
  consume<T, D>(p, plan, task, layers, ring, ks, vs, xs, barriers, sh);
  // the last CTA out zeroes the counters for the next launch
  consumer_sync();
  if (threadIdx.x == 0) {
    const int total = p.num_layers * (kStages + p.kv_heads);
    __threadfence();
    if (atomicAdd(p.counters + total, 1) == gridDim.x - 1) {
      for (int i = 0; i <= total; ++i) p.counters[i] = 0;
      __threadfence();
    }
  }
}

template <typename T, int D>
cudaError_t launch(const Params& p, int pdl, cudaStream_t stream) {
  const auto kernel = decode_layers_kernel<T, D>;
  if (p.slots > 16 || p.heads / p.kv_heads > kMaxGroup || p.hidden_size > kMaxNormPacks * 8 * kConsumers)
    return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(p.slots) * kSlotBytes + 2 * kCap * D * sizeof(T) + max_k<D>(p) * sizeof(T) +
                      p.num_layers * sizeof(LayerWeights);
  static size_t smem_allowed = 0;
  if (smem > smem_allowed) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    smem_allowed = smem;
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaLaunchAttribute attribute;  // one CTA a SM, all resident at once: they wait on each other
  const cudaLaunchConfig_t config = launch_config(dim3(sms), dim3(kThreads), smem, stream, attribute, pdl);
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace

extern "C" {

// dtype: 0 bfloat16, 1 float16; head_dim 64 or 128.
// Returns a cudaError_t.
int nanovllm_decode_layers(int dtype, const Params* p, int head_dim, int pdl, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0 && head_dim == 128) return launch<__nv_bfloat16, 128>(*p, pdl, s);
  if (dtype == 0 && head_dim == 64) return launch<__nv_bfloat16, 64>(*p, pdl, s);
  if (dtype == 1 && head_dim == 128) return launch<__half, 128>(*p, pdl, s);
  if (dtype == 1 && head_dim == 64) return launch<__half, 64>(*p, pdl, s);
  return cudaErrorInvalidValue;
}


}  // extern "C"
