#!/bin/bash
# Build llama.cpp's llama-bench (CUDA, sm_90) from .peers/llama.cpp.tar.xz into /tmp/llama.cpp, as
# .peers/llama_bench.sh does, without running it. About 5 minutes on the device's 16 cores.
set -euo pipefail
[ -x /tmp/llama.cpp/build/bin/llama-bench ] && exit 0
tar xJf .peers/llama.cpp.tar.xz -C /tmp
cmake -S /tmp/llama.cpp -B /tmp/llama.cpp/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
cmake --build /tmp/llama.cpp/build --target llama-bench -j "$(nproc)" >/dev/null
