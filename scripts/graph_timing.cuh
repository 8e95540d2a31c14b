// Shared by the stand-alone CUDA microbenchmarks of scripts/ (hop_bench.cu, icache_bench.cu, stream_beside_bench.cu).
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// A launch of grid x block on stream that may begin before the kernel before it ends (programmatic dependent
// launch); *attribute is the attribute the config points to.
inline cudaLaunchConfig_t pdl_config(dim3 grid, dim3 block, cudaStream_t stream, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid, config.blockDim = block, config.stream = stream;
  attribute->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute->val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute, config.numAttrs = 1;
  return config;
}

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

// Ends the capture on stream and times the captured graph as time_graph does: us a replay in *us.
inline int time_capture(cudaStream_t stream, float* us) {
  cudaGraph_t graph;
  CHECK(cudaStreamEndCapture(stream, &graph));
  return time_graph(graph, stream, us);
}
