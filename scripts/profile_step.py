"""Where a step's time goes on the GPU: host-side cProfile of the engine plus timed pieces.
usage: python scripts/profile_step.py [shape] [num_seqs]
Prints the step and graph-replay times, a cProfile of the host, and the kernels inside one replay."""
import cProfile
import pstats
import random
import sys
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.weights.synthetic import write_model

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
num_seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 256
llm = LLM(str(write_model(shape, tempfile.mkdtemp())), max_model_len=2048)
engine = llm.llm_engine
rng = random.Random(0)
for i in range(num_seqs):
    engine.add_request(str(i), [rng.randint(100, 30000) for _ in range(rng.randint(100, 1024))],
                       SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=400, seed=i, detokenize=False))
while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
    engine.step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(50):
    engine.step()
torch.cuda.synchronize()
print(f"decode step at {num_seqs} seqs: {(time.perf_counter() - start) / 50 * 1e3:.2f} ms")
runner = engine.model_runner
graphs = runner.graphs
bs = next(b for b in graphs.batch_sizes if b >= num_seqs)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(50):
    graphs.graphs[bs].replay()
torch.cuda.synchronize()
print(f"graph replay alone (bs {bs}): {(time.perf_counter() - start) / 50 * 1e3:.2f} ms")
prof = cProfile.Profile()
prof.enable()
for _ in range(30):
    engine.step()
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CUDA]) as kernels:
    for _ in range(20):
        graphs.graphs[bs].replay()
    torch.cuda.synchronize()
print(f"kernels of one graph replay (bs {bs}), summed over 20 replays:")
print(kernels.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
