"""The CPU path imports no Triton: a new user's `pip install torch==2.13.0 -e .` (no test extra) brings none."""
import subprocess
import sys

SCRIPT = """
import sys, tempfile
sys.modules["triton"] = None  # any import of triton now raises ImportError
import torch
from nanovllm import LLM, SamplingParams
from nanovllm.weights.synthetic import write_model
path = write_model("tiny-qwen3", tempfile.mkdtemp(), torch.float32, device="cpu")
llm = LLM(str(path), device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
params = [SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1),
          SamplingParams(max_tokens=4, temperature=0, presence_penalty=0.5, logprobs=2, prompt_logprobs=1)]
outs = llm.generate(["hello there", "a b c"], params, use_tqdm=False)
assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
print("ok")
"""


def test_cpu_generation_imports_no_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
