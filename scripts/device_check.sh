#!/bin/bash
# One device run: GPU tests, then benchmarks, each table into $OUT. Usage on the device:
#   bash scripts/device_check.sh [tests|tests1|tests2|moe|moe397|serve|bench|all|big|peer|profile|offload|weights|weights70|tp|tp4|dp]
# Tests of the bundled model skip there (the device cannot fetch it). `tests` is tests1 then tests2;
# together they take longer than one 10-minute device call (with flash_attn importable, ~190 tests ran in 540 s), so
# a call runs one of them. tests2 alone is ~8-9 minutes (142 of test_triton_kernels.py's 240 tests ran in 300 s).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
# the device lacks gguf and the network: carry its wheel in .whl/ and a tokenizer donor (../shared/peers/tok.gguf)
# in .peers/ for the synthetic GGUF files
ls .whl/gguf-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/gguf-*.whl 2>&1 | grep -v WARN
# kvikio for the disk tier (kvikio-cu13, libkvikio-cu13, rapids-logger wheels), where they were carried
ls .whl/kvikio*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/*kvikio*.whl .whl/rapids_logger*.whl \
  2>&1 | grep -v WARN
[[ -f .peers/tok.gguf ]] && export NANOVLLM_TOKENIZER_GGUF=$PWD/.peers/tok.gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
gpu_tests() {  # log name, test files
  local name=$1; shift
  python3 -m pytest -q -s -p no:cacheprovider --durations=15 "$@" 2>&1 \
    | grep -v "Loading weights" | tee "$OUT/gpu_$name.log" | tail -25
}
if [[ $what == tests || $what == tests1 || $what == all ]]; then  # the engine and the CUDA kernels
  gpu_tests tests1 tests/test_gpu.py tests/test_flash_attn_backend.py tests/test_gemv_one_row.py \
    tests/test_paged_decode_cluster.py tests/test_cuda_library.py tests/test_engine_args.py tests/test_host_pool.py \
    tests/test_sgdma.py tests/test_offload_engine.py tests/test_layer_streaming.py tests/test_layer_major.py \
    tests/test_lifecycle.py tests/test_plan.py
fi
if [[ $what == tests || $what == tests2 || $what == all ]]; then  # the Triton kernels and layers
  gpu_tests tests2 tests/test_triton_kernels.py tests/test_layers.py tests/test_gguf_gemv.py tests/test_gguf_linear.py \
    tests/test_quantize_at_load.py tests/test_synthetic_gguf.py
fi
if [[ $what == moe ]]; then  # mixtures of experts and hybrids: the fused kernels and graphs against their twins and HF
  ls .whl/fla_core-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/fla_core-*.whl 2>&1 | grep -v WARN
  gpu_tests moe tests/test_fused_moe.py tests/test_qwen3_moe.py tests/test_qwen3_next.py tests/test_expert_offload.py \
    tests/test_gated_delta_kernels.py
  python3 bench.py --model qwen3-30b-a3b --load-format dummy --mode decode1 --repeat 3 2>&1 | grep -v INFO \
    | tee "$OUT/bench_moe_decode1.md" | tail -5
  python3 bench.py --model qwen3-30b-a3b:Q4_K --mode decode1 --repeat 3 2>&1 | grep -v INFO \
    | tee "$OUT/bench_moe_q4_k_decode1.md" | tail -5
  python3 bench.py --model qwen3.5-35b-a3b:Q4_K --mode decode1 --repeat 3 2>&1 | grep -v INFO \
    | tee "$OUT/bench_hybrid_q4_k_decode1.md" | tail -5
fi
if [[ $what == moe397 ]]; then  # Qwen3.5-397B-A17B, Q4_K experts drawn at load, those past ~100 GiB in pinned host
  # memory (nvidia-h200-x2: 256 GB of host memory; one of its GPUs)
  ls .whl/fla_core-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/fla_core-*.whl 2>&1 | grep -v WARN
  timeout 560 python3 bench_offload.py experts --model qwen3.5-397b-a17b:Q4_K --load-format dummy --offload-gb 140 \
    --batch-sizes 1 64 --output-len 16 2>&1 | grep -v INFO | tee "$OUT/bench_moe397.md" | tail -8
fi
if [[ $what == serve ]]; then  # nanovllm serve under 256 concurrent streams against LLM.generate; time to first token
  ls .whl/serve/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/serve/*.whl 2>&1 | grep -v WARN
  python3 bench_serve.py 2>&1 | grep -v INFO | tee "$OUT/bench_serve.md" | tail -12
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench.py --repeat 3 2>&1 | grep -v INFO | tee "$OUT/bench_throughput.md" | tail -10
  python3 bench.py --max-num-batched-tokens 8192 2>&1 | grep -v INFO | tee "$OUT/bench_throughput_8k.md" | tail -3
  python3 bench.py --mode decode1 --model qwen3-0.6b 2>&1 | grep -v INFO | tee "$OUT/bench_decode1_qwen3.md" | tail -5
  for flags in NANOVLLM_GEMV_CUDA=0 NANOVLLM_DECODE_CUDA=0; do
    echo "decode1 with $flags (the Triton GEMV / decode attention instead of the CUDA one)"
    env $flags python3 bench.py --mode decode1 --model qwen3-0.6b 2>&1 | grep -v INFO \
      | tee "$OUT/bench_decode1_qwen3_${flags// /_}.md" | tail -1
  done
  python3 bench.py --mode sweep --plot "$OUT/decode_vs_batch.png" 2>&1 | grep -v INFO | tee "$OUT/bench_sweep.md" | tail -9
fi
if [[ $what == profile ]]; then  # where the time goes: the throughput run's steps and their kernels
  python3 scripts/profile_bench.py --trace 0:4 300:306 700:706 2>&1 | grep -v INFO | tee "$OUT/profile_bench.md" | tail -14
fi
if [[ $what == peer ]]; then  # after scripts/build_llama_cpp.sh
  python3 scripts/peer_llama_cpp.py F16 2>&1 | grep -v "INFO\|it/s" | tee "$OUT/peer_llama_cpp.md" | tail -4
  python3 scripts/peer_llama_cpp.py --shape small F16 2>&1 | grep -v "INFO\|it/s" | tee "$OUT/peer_llama_cpp_small.md" | tail -4
fi
if [[ $what == offload ]]; then  # KV beyond the GPU (issue #42); ~7 minutes
  python3 bench_offload.py copies 2>&1 | grep -v INFO | tee "$OUT/bench_offload_copies.md" | tail -14
  python3 bench_offload.py long --model qwen3-0.6b --prompt-len 8192 32768 131072 --gpu-tokens 2048 2>&1 \
    | grep -v INFO | tee "$OUT/bench_offload_long.md" | tail -7
  python3 bench_offload.py long --model qwen3-0.6b --prompt-len 8192 --num-prompts 4 --gpu-tokens 2048 2>&1 \
    | grep -v INFO | tee "$OUT/bench_offload_long_batched.md" | tail -3
  python3 bench_offload.py batch --prompt-len 1024 --output-len 2048 --batch-sizes 16 2>&1 | grep -v INFO \
    | tee "$OUT/bench_offload_batch.md" | tail -6
fi
if [[ $what == weights ]]; then  # weights streamed from host memory and disk (issue #43); ~6 minutes
  python3 bench_offload.py weights --model llama3-8b:Q4_K --placements 0:0 0.5:0 0:0.25 2>&1 | grep -v INFO \
    | tee "$OUT/bench_offload_weights.md" | tail -8
  python3 bench_offload.py weights --model llama3-8b:Q4_K --placements 0:0 0.5:0 --batch-sizes 1 8 32 64 128 256 \
    --plot "$OUT/streamed_vs_batch.png" 2>&1 | grep -v INFO | tee "$OUT/bench_offload_weights_curve.md" | tail -14
fi
if [[ $what == weights70 ]]; then  # a 70B-class Q4_K (~39 GB) in 24 GiB of VRAM, the rest streamed (issue #43)
  gguf70=/tmp/llama3-70b-q4_k.gguf  # written once (kept for a back-to-back call); each placement a run of its own,
  [[ -f $gguf70 ]] || python3 -m nanovllm.weights.synthetic_gguf llama3-70b Q4_K $gguf70 \
    ${NANOVLLM_TOKENIZER_GGUF:+--tokenizer $NANOVLLM_TOKENIZER_GGUF} > /dev/null  # so that a slow one leaves the rows
  plot=(--plot "$OUT/streamed_70b_vs_batch.png")  # of those before it
  for placement in 0.6:0 0.5:0.1 0:0; do
    timeout 280 python3 bench_offload.py weights --model $gguf70 --vram-gb 24 --placements $placement \
      --batch-sizes 1 32 128 --output-len 16 "${plot[@]}" 2>&1 | grep --line-buffered -v INFO \
      | tee -a "$OUT/bench_offload_weights_70b.md" | tail -4
    plot=()
  done
fi
if [[ $what == tp ]]; then  # tensor parallelism, on a machine of 2 GPUs (nvidia-h100-x2); ~9 minutes
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
  (python3 -m nanovllm.weights.synthetic llama3-8b /tmp/llama3-8b >/dev/null 2>&1 &)
  gpu_tests tp tests/test_custom_all_reduce.py tests/test_tensor_parallel.py
  while pgrep -f "weights.synthetic" >/dev/null; do sleep 2; done
  for tp in 1 2; do  # bs=1 decode, then nano-vLLM's throughput workload
    timeout 150 python3 bench.py --mode decode1 --model /tmp/llama3-8b --tensor-parallel-size $tp 2>&1 \
      | grep -v INFO | tee "$OUT/bench_decode1_llama3_tp$tp.md" | tail -2
    timeout 200 python3 bench.py --model /tmp/llama3-8b --tensor-parallel-size $tp 2>&1 | grep -v INFO \
      | tee "$OUT/bench_throughput_llama3_tp$tp.md" | tail -2
  done
fi
if [[ $what == tp4 ]]; then  # a 70B-class Llama in bf16 (~140 GB) over 4 GPUs (nvidia-h100-x4), issue #44
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
  # the weights are drawn on each GPU at load (load_format dummy): no 140 GB file to write and read back
  timeout 260 python3 bench.py --mode decode1 --model llama3-70b --load-format dummy --tensor-parallel-size 4 \
    --max-num-seqs 8 --max-num-batched-tokens 1024 2>&1 | grep -v INFO \
    | tee "$OUT/bench_decode1_llama3_70b_tp4.md" | tail -2
  timeout 260 python3 bench.py --model llama3-70b --load-format dummy --tensor-parallel-size 4 2>&1 | grep -v INFO \
    | tee "$OUT/bench_throughput_llama3_70b_tp4.md" | tail -2
fi
if [[ $what == dp ]]; then  # data parallel over 2 GPUs: nano-vLLM's workload twice over; ~4 minutes
  for dp in 1 2; do
    python3 bench.py --num-seqs 512 --data-parallel-size $dp 2>&1 | grep -v INFO | tee "$OUT/bench_dp$dp.md" | tail -2
  done
fi
if [[ $what == big ]]; then
  python3 -m nanovllm.weights.synthetic llama3-8b /tmp/llama3-8b >/dev/null
  python3 bench.py --mode decode1 --model /tmp/llama3-8b 2>&1 | grep -v INFO | tee "$OUT/bench_decode1_llama3.md" | tail -5
  python3 bench.py --mode prefill --model /tmp/llama3-8b 2>&1 | grep -v INFO | tee "$OUT/bench_prefill_llama3.md" | tail -5
fi
