"""nanovllm and llama.cpp side by side on the same GGUF file, in one device run: pp512 (prompt tok/s) and
tg128 (bs=1 decode tok/s), as llama-bench defines them.

    bash scripts/build_llama_cpp.sh   # once: builds /tmp/llama.cpp/build/bin/llama-bench from .peers
    python scripts/peer_llama_cpp.py F16 [Q8_0 ...]
    python scripts/peer_llama_cpp.py --shape small F16  # Qwen3-0.6B's layer sizes in a llama layout

.peers/ holds a copy of ../shared/peers (make_gguf.py, tok.gguf). The model is the Llama-3-8B shape (or `small`: 28
layers, hidden 1024, MLP 3072, 16 heads of 64, 8 kv heads) with the SmolLM2 vocabulary (49152), random weights; both
engines read the very same file. tg128 is also given against the weight-read bound: the file's tensors but the
token embedding table (a step reads one row of it), over the HBM bandwidth measured in the same run."""
import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.benchmarking import measure_hbm_bandwidth

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".peers")
# shapes beside make_gguf.py's own: name -> its SHAPES entry
EXTRA_SHAPES = {"small": "dict(n_layer=28, d=1024, ff=3072, heads=16, kv=8)"}
SHAPE_NAMES = {"llama3-8b": "Llama-3-8B shape", "small": "Qwen3-0.6B's layer sizes (llama layout, head_dim 64)"}
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


def write_gguf(shape: str, qtype: str, path: str):
    """make_gguf.py's file; a shape of EXTRA_SHAPES goes into its SHAPES table first."""
    source = open(os.path.join(PEERS, "make_gguf.py")).read()
    if shape in EXTRA_SHAPES:
        source = source.replace("SHAPES = {", f"SHAPES = {{{shape!r}: {EXTRA_SHAPES[shape]}, ", 1)
    subprocess.run([sys.executable, "-c", source, shape, qtype, os.path.join(PEERS, "tok.gguf"), path], check=True,
                   capture_output=True)


def bytes_per_step(path: str) -> int:
    """Weight bytes a bs=1 decode step reads: every tensor once, one row of the token embedding table."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("qtypes", nargs="*", default=["F16"])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPE_NAMES))
    args = ap.parse_args()
    bw = measure_hbm_bandwidth()
    rows = []
    for qtype in args.qtypes:
        path = f"/tmp/peer_{args.shape}_{qtype}.gguf"
        if not os.path.exists(path):
            write_gguf(args.shape, qtype, path)
        peer, ours = llama_cpp(path), nanovllm(path)
        size = os.path.getsize(path) / (1 << 30)
        bound = bw / bytes_per_step(path)
        rows.append(f"| {qtype} | {size:.2f} GiB | {ours['pp512']:,.0f} | {peer['pp512']:,.0f} | "
                    f"{ours['pp512'] / peer['pp512']:.2f}x | {ours['tg128']:,.1f} | {peer['tg128']:,.1f} | "
                    f"{ours['tg128'] / peer['tg128']:.2f}x | {bound:,.0f} ({ours['tg128'] / bound:.0%} / "
                    f"{peer['tg128'] / bound:.0%}) |")
    print(f"\n| device | date | model | config |\n|---|---|---|---|\n| {torch.cuda.get_device_name()} | "
          f"{datetime.date.today()} | {SHAPE_NAMES[args.shape]}, vocab 49152, random weights (same GGUF file) | "
          f"pp512: one 512-token prompt; tg128: 128 tokens bs=1; llama.cpp -fa 1 -ngl 99 -r 3; ours median of 3-5; "
          f"HBM {bw / 1e12:.2f} TB/s |\n")
    print("| GGUF type | file | nanovllm pp512 tok/s | llama.cpp pp512 | ratio | nanovllm tg128 tok/s | llama.cpp tg128 "
          "| ratio | tg128 weight-read bound (nanovllm / llama.cpp) |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
