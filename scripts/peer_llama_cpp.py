"""nanovllm and llama.cpp side by side on the same GGUF file, in one device run: pp512 (prompt tok/s) and
tg128 (bs=1 decode tok/s), as llama-bench defines them.

    bash scripts/build_llama_cpp.sh   # once: builds /tmp/llama.cpp/build/bin/llama-bench from .peers
    python scripts/peer_llama_cpp.py F16 [Q8_0 ...]

.peers/ holds a copy of ../shared/peers (make_gguf.py, tok.gguf). The model is the Llama-3-8B shape with the
SmolLM2 vocabulary (49152), random weights; both engines read the very same file."""
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from nanovllm import LLM, SamplingParams

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".peers")
LLAMA_BENCH = "/tmp/llama.cpp/build/bin/llama-bench"


def llama_cpp(path: str) -> dict[str, float]:
    out = subprocess.run([LLAMA_BENCH, "-m", path, "-p", "512", "-n", "128", "-ngl", "99", "-fa", "1", "-r", "3",
                          "-o", "md"], check=True, capture_output=True, text=True).stdout
    figures = {}
    for line in out.splitlines():
        m = re.search(r"\|\s*(pp512|tg128)\s*\|\s*([\d.]+)", line)
        if m:
            figures[m.group(1)] = float(m.group(2))
    return figures


def timed(llm, prompt, max_tokens) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens,
                                                                detokenize=False), use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def nanovllm(path: str) -> dict[str, float]:
    llm = LLM(path, max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False)
    prompt = list(range(1000, 1512))
    timed(llm, prompt, 8)
    pp = statistics.median(timed(llm, prompt, 1) for _ in range(5))
    short = prompt[:16]
    first = statistics.median(timed(llm, short, 1) for _ in range(3))
    tg = statistics.median(timed(llm, short, 129) for _ in range(3)) - first
    del llm
    torch.cuda.empty_cache()
    return {"pp512": 512 / pp, "tg128": 128 / tg}


def main():
    rows = []
    for qtype in sys.argv[1:] or ["F16"]:
        path = f"/tmp/peer_{qtype}.gguf"
        if not os.path.exists(path):
            subprocess.run([sys.executable, os.path.join(PEERS, "make_gguf.py"), "llama3-8b", qtype,
                            os.path.join(PEERS, "tok.gguf"), path], check=True, capture_output=True)
        peer, ours = llama_cpp(path), nanovllm(path)
        size = os.path.getsize(path) / (1 << 30)
        rows.append(f"| {qtype} | {size:.2f} GiB | {ours['pp512']:,.0f} | {peer['pp512']:,.0f} | "
                    f"{ours['pp512'] / peer['pp512']:.2f}x | {ours['tg128']:,.1f} | {peer['tg128']:,.1f} | "
                    f"{ours['tg128'] / peer['tg128']:.2f}x |")
    print(f"\n| device | date | model | config |\n|---|---|---|---|\n| {torch.cuda.get_device_name()} | "
          f"{datetime.date.today()} | Llama-3-8B shape, vocab 49152, random weights (same GGUF file) | "
          f"pp512: one 512-token prompt; tg128: 128 tokens bs=1; llama.cpp -fa 1 -ngl 99 -r 3; ours median of 3-5 |\n")
    print("| GGUF type | file | nanovllm pp512 tok/s | llama.cpp pp512 | ratio | nanovllm tg128 tok/s | llama.cpp tg128 "
          "| ratio |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
