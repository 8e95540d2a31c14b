"""How long one 32 KB weight tile's products take on the CUDA cores (16 rows x 1024 bf16 from shared memory, 8
warps, one CTA per SM), the figure behind the one-kernel step's tensor-core tiles (csrc/decode_layers.cu) and the
one-row GEMV's dot phases (docs/benchmarks.md, eleventh session). Variants: 16 threads a row with strided packs and
four FMA chains; a warp a row with one chain (the one-row GEMV's scheme); all loads issued first; the first with
bulk copies landing in the other slots meanwhile. Prints SM cycles (clock64) per tile, median over CTAs and reps.

    python scripts/tile_dot_bench.py        (Hopper GPU, nvcc)
"""
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.kernels import cuda_library  # noqa: E402

SOURCE = r"""
#include "common.cuh"
using namespace nanovllm;
constexpr int kThreads = 288;  // 8 consumer warps + 1 (idle or background copier)
constexpr int kRows = 16, kK = 1024, kPacks = kK / 8;

__device__ __forceinline__ void bar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bwait(uint64_t* b, uint32_t par) {
  uint32_t d = 0;
  while (!d)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(d) : "r"(smem_addr(b)), "r"(par) : "memory");
}
__device__ __forceinline__ void bcopy(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

template <int V>
__device__ __forceinline__ float tile_dot(const __nv_bfloat16* ws, const __nv_bfloat16* xs) {
  const int t = threadIdx.x;
  if (V == 0 || V == 4) {  // 16 threads a row, strided packs, 4 chains (decode_layers.cu's dot_part)
    const int r = t / 16, j = t % 16;
    float acc[4] = {};
#pragma unroll 4
    for (int v = j; v < kPacks; v += 16) {
      Pack<__nv_bfloat16> w, x;
      w.bits = reinterpret_cast<const uint4*>(ws + r * kK)[v];
      x.bits = reinterpret_cast<const uint4*>(xs)[v];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e % 4] += to_float(w.v[e]) * to_float(x.v[e]);
    }
    float y = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (int o = 8; o > 0; o /= 2) y += __shfl_xor_sync(0xffffffffu, y, o);
    return y;
  }
  if (V == 1) {  // a warp a row, 2 rows a warp, one chain
    const int warp = t / 32, lane = t % 32;
    float res = 0.f;
    for (int r = warp; r < kRows; r += 8) {
      float acc = 0.f;
#pragma unroll 4
      for (int v = lane; v < kPacks; v += 32) {
        Pack<__nv_bfloat16> w, x;
        w.bits = reinterpret_cast<const uint4*>(ws + r * kK)[v];
        x.bits = reinterpret_cast<const uint4*>(xs)[v];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += to_float(w.v[e]) * to_float(x.v[e]);
      }
      res += warp_sum(acc);
    }
    return res;
  }
  // V == 2: all 8 packs' loads first (compile-time count), then the products
  const int r = t / 16, j = t % 16;
  uint4 w[8], x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    w[i] = reinterpret_cast<const uint4*>(ws + r * kK)[j + 16 * i];
    x[i] = reinterpret_cast<const uint4*>(xs)[j + 16 * i];
  }
  float acc[4] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    Pack<__nv_bfloat16> a, b;
    a.bits = w[i], b.bits = x[i];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e % 4] += to_float(a.v[e]) * to_float(b.v[e]);
  }
  float y = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (int o = 8; o > 0; o /= 2) y += __shfl_xor_sync(0xffffffffu, y, o);
  return y;
}

template <int V>
__global__ void __launch_bounds__(kThreads, 1) bench(const __nv_bfloat16* w, const __nv_bfloat16* x, float* out,
                                                     long long* cycles, int tiles) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[6];
  __nv_bfloat16* ring = reinterpret_cast<__nv_bfloat16*>(smem);  // 5 slots of 32 KB
  __nv_bfloat16* xs = ring + 5 * kRows * kK;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 6; ++i) bar_init(&bars[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const __nv_bfloat16* mine = w + static_cast<size_t>(blockIdx.x % tiles) * kRows * kK;
  if (threadIdx.x == 0) { expect(&bars[0], 32768); bcopy(ring, mine, 32768, &bars[0]); }
  for (int i = threadIdx.x; i < kK / 8; i += kThreads) reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
  bwait(&bars[0], 0);
  __syncthreads();
  if (threadIdx.x >= 256) {  // V4: background bulk copies into slots 1-4 the whole time
    if (V == 4 && threadIdx.x == 256) {
      for (int rep = 0; rep < 40; ++rep) {
        const int s = 1 + rep % 4;
        if (rep >= 4) bwait(&bars[s], ((rep / 4) - 1) & 1);
        expect(&bars[s], 32768);
        bcopy(ring + s * kRows * kK, w + static_cast<size_t>((blockIdx.x + 7 * rep) % tiles) * kRows * kK, 32768, &bars[s]);
      }
    }
    return;
  }
  float sink = 0.f;
  for (int rep = 0; rep < 8; ++rep) {
    csync();
    const long long t0 = clock64();
    sink += tile_dot<V>(ring, xs);
    csync();
    const long long t1 = clock64();
    if (threadIdx.x == 0) cycles[blockIdx.x * 8 + rep] = t1 - t0;
  }
  if (sink == 12345.f) out[threadIdx.x] = sink;
}

extern "C" int run(int v, const void* w, const void* x, float* out, long long* cycles, int tiles, int sms, void* stream) {
  const size_t smem = 5 * 32768 + 2048;
  auto go = [&](auto kernel) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    kernel<<<sms, kThreads, smem, (cudaStream_t)stream>>>((const __nv_bfloat16*)w, (const __nv_bfloat16*)x, out, cycles, tiles);
    return (int)cudaGetLastError();
  };
  if (v == 0) return go(bench<0>);
  if (v == 1) return go(bench<1>);
  if (v == 2) return go(bench<2>);
  return go(bench<4>);
}
"""
VARIANTS = {0: "16 threads a row, strided packs, 4 FMA chains", 1: "a warp a row, one FMA chain (one-row GEMV)",
            2: "16 threads a row, all 16 loads first", 4: "as the first, bulk copies landing beside"}


def build(out_dir: str) -> ctypes.CDLL:
    source = Path(out_dir) / "tile_dot_bench.cu"
    source.write_text(SOURCE)
    target = Path(out_dir) / "tile_dot_bench.so"
    subprocess.run([cuda_library.nvcc(), *cuda_library.NVCC_FLAGS, "-I", str(cuda_library.CSRC), "-o", str(target),
                    str(source)], check=True)
    return ctypes.CDLL(str(target))


def main():
    library = build(tempfile.mkdtemp())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = 256
    w = torch.randn(tiles * 16 * 1024, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(512, device="cuda")
    cycles = torch.zeros(sms * 8, dtype=torch.int64, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {sms} CTAs\n| variant | cycles a tile (median) | max |\n|---|---|---|")
    for variant, name in VARIANTS.items():
        for _ in range(3):
            error = library.run(variant, ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(cycles.data_ptr()), tiles, sms,
                                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            assert error == 0, error
        torch.cuda.synchronize()
        c = cycles.view(sms, 8)[:, 2:].double()  # the first two reps of each CTA warm up
        print(f"| {name} | {c.median().item():.0f} | {c.max().item():.0f} |")


if __name__ == "__main__":
    main()
