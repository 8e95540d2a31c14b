"""The kernels of a steady bs=1 decode step outside its 28 layers (Qwen3-0.6B shape, prompt 512, as bench.py
decode1): when each starts after the step's first qkv GEMV, how long it runs, and the gap since the kernel before
(negative: launched under PDL while that one ran), from torch.profiler over 40 steps; then every kernel's mean.
usage: python scripts/decode_step_tail.py (a CUDA GPU)"""
import random
import sys
import types

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import bench  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402

args = types.SimpleNamespace(device="cuda", attention_backend=None, max_model_len=None, max_num_seqs=None)
model = bench.resolve_model("qwen3-0.6b", torch.bfloat16)
llm = bench.make_llm(args, model, torch.bfloat16, enable_prefix_caching=False)  # bench.py decode1's engine
prompt = [random.Random(0).randint(100, 20000) for _ in range(512)]
params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40, detokenize=False)
bench.timed_generate(llm, [prompt], params, "cuda")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    bench.timed_generate(llm, [prompt], params, "cuda")
kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                  and "memset" not in e.name.lower()), key=lambda e: e.time_range.start)
gemvs = [i for i, e in enumerate(kernels) if "gemv_one_row" in e.name]
starts = [gemvs[0]] + [b for a, b in zip(gemvs, gemvs[1:]) if b - a > 3]  # a step's first qkv GEMV (us below)
for first, after in zip(starts[-3:-1], starts[-2:]):
    step, t0 = kernels[first:after], kernels[first].time_range.start
    last_layer = max(i for i, e in enumerate(step) if "gemv_one_row" in e.name)
    print(f"step: {len(step)} kernels, {step[-1].time_range.end - t0:.1f} us; the layers end at "
          f"{step[last_layer].time_range.end - t0:.1f} us")
    before = step[last_layer - 1].time_range.end
    for e in step[last_layer:] + kernels[after:after + 2]:
        print(f"  start {e.time_range.start - t0:7.1f}  runs {e.time_range.elapsed_us():6.1f}  "
              f"gap {e.time_range.start - before:5.1f}  {e.name[:100]}")
        before = e.time_range.end
means: dict[str, list[float]] = {}
for e in kernels:
    means.setdefault(e.name[:100], []).append(e.time_range.elapsed_us())
for name, runs in sorted(means.items(), key=lambda kv: -sum(kv[1])):
    print(f"{len(runs):5d} x {sum(runs) / len(runs):8.2f} us  {name}")
