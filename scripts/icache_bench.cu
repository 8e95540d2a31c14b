// Does a chain of different kernels pay for instruction fetch? 140 dependent PDL kernels in a CUDA graph (264 CTAs
// x 128 threads, each: wait, then BODY unrolled FMAs on 8 independent chains, then one store), either the same
// kernel 140 times or 5 different kernels (the same work, distinct code) in turn, as a bs=1 decode layer runs its
// four GEMVs and its attention kernel. Prints us a kernel. H100 (eighteenth session, docs/benchmarks.md): 8 KB
// kernels 0.88 vs 1.09 us, 16 KB 1.13 vs 1.70, 32 KB 1.81 vs 6.44: five alternating kernels whose code outgrows
// the SM's instruction cache pay for fetching it at every launch.
//   nvcc -O3 -gencode arch=compute_90,code=sm_90 -o /tmp/icache_bench scripts/icache_bench.cu && /tmp/icache_bench
#include "graph_timing.cuh"

template <int ID, int BODY>
__global__ void __launch_bounds__(128) work(const float* x, float* y) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  float a[8];
  const float s = __ldcg(x + threadIdx.x) + ID;
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = s + j;
#pragma unroll
  for (int i = 0; i < BODY / 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = fmaf(a[j], 0.999f + 1e-6f * (i % 7), s * (j + ID + 1));
  float t = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) t += a[j];
  if (blockIdx.x == 0) y[threadIdx.x] = t;
}

typedef void (*Kernel)(const float*, float*);

template <int BODY>
int run(int distinct, float* rows, cudaStream_t stream) {
  Kernel kernels[5] = {work<0, BODY>, work<1, BODY>, work<2, BODY>, work<3, BODY>, work<4, BODY>};
  const int chain = 140;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int k = 0; k < chain; ++k) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = pdl_config(dim3(264), dim3(128), stream, &attribute);
    CHECK(cudaLaunchKernelEx(&config, kernels[k % distinct], (const float*)(rows + (k % 2) * 128), rows + ((k + 1) % 2) * 128));
  }
  float us;
  if (time_capture(stream, &us)) return 1;
  printf("| %d FMAs (~%d KB of code) | %d | %.3f |\n", BODY, BODY * 16 / 1024, distinct, us / chain);
  return 0;
}

int main() {
  float* rows; CHECK(cudaMalloc(&rows, 256 * sizeof(float))); CHECK(cudaMemset(rows, 0, 256 * sizeof(float)));
  cudaStream_t stream; cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  printf("| kernel body | distinct kernels in turn | us a kernel |\n|---|---|---|\n");
  run<64>(1, rows, stream); run<64>(5, rows, stream);
  run<512>(1, rows, stream); run<512>(5, rows, stream);
  run<1024>(1, rows, stream); run<1024>(5, rows, stream);
  run<2048>(1, rows, stream); run<2048>(5, rows, stream);
  run<4096>(1, rows, stream); run<4096>(5, rows, stream);
  return 0;
}
