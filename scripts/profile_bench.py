"""Where bench.py's throughput run spends its time: engine steps timed one by one and grouped by what they
ran (prefill, or decode at a batch size range), each group beside its HBM bound (weights + KV read) and the
host's wait for the step's tokens (near 0: the host, not the GPU, set the pace) and how many steps it did not wait
at all; then the run's garbage collections.
With --trace FIRST:LAST ..., those step windows also run under torch.profiler: per window, how busy the GPU was,
its kernels, and its idle gaps, largest first (a window's first step starts on an
idle GPU: the profiler starts after a synchronize). --export DIR writes each window's Chrome trace.
usage: python scripts/profile_bench.py [same workload flags as bench.py] [--trace 0:4 300:306] [--export DIR]"""
import argparse
import collections
import gc
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.runtime.jit import JITFunction

from nanovllm import LLM, SamplingParams
from nanovllm.utils.benchmarking import (
    kv_bytes_per_token,
    make_workload,
    measure_hbm_bandwidth,
    resolve_model,
    weight_bytes_per_step,
)


def report_window(prof, name: str):
    """GPU busy time, top kernels and idle gaps of one traced window."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    if not spans:
        return
    busy, end, gaps = 0.0, spans[0][0], []
    for start, stop, kernel in spans:
        if start > end:
            gaps.append((start - end, kernel))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - spans[0][0]
    print(f"\n## steps {name}: {span / 1e3:.2f} ms, GPU busy {busy / span:.0%}, "
          f"{sum(g for g, _ in gaps) / 1e3:.2f} ms idle in {len(gaps)} gaps (largest: "
          + ", ".join(f"{g:.0f} us before {k[:30]}" for g, k in sorted(gaps, reverse=True)[:4]) + ")")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="qwen3-0.6b")
ap.add_argument("--num-seqs", type=int, default=256)
ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--max-num-batched-tokens", type=int, default=None)
ap.add_argument("--trace", nargs="*", default=[], help="step windows FIRST:LAST to trace")
ap.add_argument("--export", default=None, help="a folder for the windows' Chrome traces")
args = ap.parse_args()
windows = {int(w.split(":")[0]): int(w.split(":")[1]) for w in args.trace}
model = resolve_model(args.model, torch.bfloat16)
prompts, out_lens = make_workload(args, 30000)
llm = LLM(model, max_num_batched_tokens=args.max_num_batched_tokens)  # bench.py's engine
llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
engine = llm.llm_engine
runner = engine.model_runner
weight_bytes = weight_bytes_per_step(runner.model)
launched = []
launch = runner.launch


def recording_launch(seqs, *args, **kw):
    launched.append((len(seqs), sum(s.num_scheduled_tokens > 1 for s in seqs),
                     sum(s.num_computed_tokens + s.num_scheduled_tokens for s in seqs)))
    return launch(seqs, *args, **kw)


runner.launch = recording_launch
waited = [0.0]  # host seconds spent waiting for a step's tokens (collect's event wait; GPU-bound while it is > 0)
event_wait = torch.cuda.Event.synchronize


def timed_event_wait(event):
    t0 = time.perf_counter()
    event_wait(event)
    waited[0] += time.perf_counter() - t0


torch.cuda.Event.synchronize = timed_event_wait
gc_runs = collections.defaultdict(lambda: [0, 0.0])  # generation -> collections, seconds
gc_start = [0.0]


def gc_callback(phase, info):
    if phase == "start":
        gc_start[0] = time.perf_counter()
    else:
        gc_runs[info["generation"]][0] += 1
        gc_runs[info["generation"]][1] += time.perf_counter() - gc_start[0]


compiles = []  # Triton kernels compiled (or loaded from the disk cache) inside the timed run
do_compile = JITFunction._do_compile


def counting_compile(self, *a, **kw):
    t0 = time.perf_counter()
    kernel = do_compile(self, *a, **kw)
    compiles.append((self.__name__, time.perf_counter() - t0))
    return kernel


JITFunction._do_compile = counting_compile
prefill_ms = []
HOST_BOUND_WAIT = 20e-6  # seconds: a step whose tokens were ready this soon was waiting on the host
for i, (p, n) in enumerate(zip(prompts, out_lens)):
    engine.add_request(str(i), p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i,
                                                 detokenize=False))
# steps, seconds, bound bytes, seconds waited, steps the host did not wait for (it, not the GPU, set their pace)
groups = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
torch.cuda.synchronize()
gc.callbacks.append(gc_callback)  # from here: the timed run
start = time.perf_counter()
step, prof, traced = 0, None, 0.0
while engine.has_unfinished_requests():
    if step in windows:
        torch.cuda.synchronize()
        prof, first = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]), step
        prof.start()
    launched.clear()
    waited[0] = 0.0
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    step += 1
    if prof is not None and step == windows[first]:
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        prof.stop()
        report_window(prof, f"{first}..{step - 1}")
        if args.export:
            prof.export_chrome_trace(f"{args.export}/trace_steps_{first}_{step - 1}.json")
        prof = None
        traced += time.perf_counter() - t1
    if not launched:
        continue
    num_seqs, prefills, context = launched[0]
    if prefills:
        prefill_ms.append(f"{dt * 1e3:.0f}")
    key = "prefill (mixed)" if prefills else f"decode bs {1 << (num_seqs - 1).bit_length():>3}"
    g = groups[key]
    g[0] += 1
    g[1] += dt
    g[2] += weight_bytes + context * kv_bytes_per_token(runner)
    g[3] += waited[0]
    g[4] += waited[0] < HOST_BOUND_WAIT
total = time.perf_counter() - start - traced  # less the reporting of traced windows
bw = measure_hbm_bandwidth()
print(f"{torch.cuda.get_device_name()}: {args.num_seqs} seqs, total {total:.2f} s, copy bandwidth {bw / 1e12:.2f} TB/s")
print("| steps | count | seconds | ms/step | bound ms/step | of bound | share of run | host waited ms/step "
      f"| host-bound steps (waited < {HOST_BOUND_WAIT * 1e3:g} ms) |\n"
      "|---|---|---|---|---|---|---|---|---|")
for key in sorted(groups):
    n, s, b, w, host_bound = groups[key]
    print(f"| {key} | {n} | {s:.2f} | {s / n * 1e3:.2f} | {b / bw / n * 1e3:.2f} | {b / bw / s:.0%} | {s / total:.0%} "
          f"| {w / n * 1e3:.2f} | {host_bound} |")
print("garbage collections in the timed run: " + ", ".join(
    f"gen {g}: {n} ({t * 1e3:.1f} ms)" for g, (n, t) in sorted(gc_runs.items())))
print(f"prefill steps, ms: {' '.join(prefill_ms)}")
decode_steps = sum(g[0] for key, g in groups.items() if key.startswith("decode"))
print(f"decode steps replayed with their inputs left on the device (steady): {runner.num_steady_steps} of {decode_steps}")
print(f"Triton compiles in the timed run: {len(compiles)} " + " ".join(f"{n} ({t:.2f} s)" for n, t in compiles))
