// Shared by the stand-alone CUDA microbenchmarks of scripts/ (hop_bench.cu, icache_bench.cu).
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// Instantiates the captured graph, replays it 20 times to warm up, then times 200 replays: us a replay in *us.
inline int time_graph(cudaGraph_t graph, cudaStream_t stream, float* us) {
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 20; ++i) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const int reps = 200;
  cudaEventRecord(a, stream);
  for (int i = 0; i < reps; ++i) CHECK(cudaGraphLaunch(exec, stream));
  cudaEventRecord(b, stream);
  CHECK(cudaEventSynchronize(b));
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  *us = ms * 1000.f / reps;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return 0;
}
