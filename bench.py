"""Offline throughput: nano-vLLM's workload (random token prompts, ignore_eos), our engine and, with --hf,
HF transformers' batched generate on the same prompts in the same run. Prints one table.

    python bench.py                                     # GPU: 256 seqs, in/out U[100,1024], Qwen3-0.6B shape
    python bench.py --device cpu --model smollm2 --num-seqs 32 --input-len 100 300 --output-len 128 128 --hf
"""
import argparse
import datetime
import platform
import random
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.weights.bundled import bundled_model_path
from nanovllm.weights.synthetic import SHAPES, write_model


def resolve_model(name: str, dtype: torch.dtype) -> str:
    if name == "smollm2":
        return bundled_model_path()
    if name in SHAPES:
        return str(write_model(name, tempfile.mkdtemp(prefix=f"nanovllm-{name}-"), dtype))
    return name


def make_workload(args, vocab: int):
    rng = random.Random(args.seed)
    prompts, out_lens = [], []
    for _ in range(args.num_seqs):
        n = rng.randint(*args.input_len)
        prompts.append([rng.randint(100, vocab - 1) for _ in range(n)])
        out_lens.append(rng.randint(*args.output_len))
    return prompts, out_lens


def run_ours(args, model, prompts, out_lens, dtype):
    llm = LLM(model, device=args.device, dtype=dtype, enforce_eager=args.enforce_eager,
              max_model_len=max(map(len, prompts)) + max(out_lens), max_num_seqs=args.max_num_seqs)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i) for i, n in enumerate(out_lens)]
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(args.device)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
    return seconds


def run_hf(args, model, prompts, out_lens, dtype):
    """HF transformers' generate, one padded batch (the output length is the workload's longest)."""
    import os

    from transformers import AutoModelForCausalLM

    kw = dict(gguf_file=os.path.basename(model)) if model.endswith(".gguf") else {}
    path = os.path.dirname(model) if model.endswith(".gguf") else model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(args.device).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    n = max(out_lens)
    sync(args.device)
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device), max_new_tokens=n,
                    min_new_tokens=n, do_sample=True, temperature=0.6, top_k=0, pad_token_id=0)
    sync(args.device)
    return time.perf_counter() - start


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a path, 'smollm2', or a synthetic shape: " + ", ".join(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers' batched generate")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    model = resolve_model(args.model, dtype)
    from transformers import AutoConfig

    vocab = 49152 if model.endswith(".gguf") else AutoConfig.from_pretrained(model).vocab_size
    prompts, out_lens = make_workload(args, vocab)
    total_out = sum(out_lens)
    rows = [("nanovllm", run_ours(args, model, prompts, out_lens, dtype), total_out)]
    if args.hf:
        rows.append(("HF transformers generate (padded batch)", run_hf(args, model, prompts, out_lens, dtype),
                     len(prompts) * max(out_lens)))
    if args.device.startswith("cuda"):
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU {platform.machine()}, {torch.get_num_threads()} threads"
    print(f"\n| device | date | model | dtype | seqs | input | output |\n|---|---|---|---|---|---|---|\n"
          f"| {device} | {datetime.date.today()} | {args.model} | {str(dtype).removeprefix('torch.')} | {args.num_seqs} "
          f"| U{args.input_len} ({sum(map(len, prompts))} tok) | U{args.output_len} ({total_out} tok) |\n")
    print("| engine | output tokens | seconds | output tok/s | vs nanovllm |\n|---|---|---|---|---|")
    ours = rows[0][2] / rows[0][1]
    for name, seconds, tokens in rows:
        print(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:.1f} | {ours / (tokens / seconds):.2f}x |")


if __name__ == "__main__":
    main()
