"""The peer of bench.py's throughput workload: vLLM when it is importable, else HF transformers' continuous
batching (`generate_batch`, paged attention). Same prompts, same table format.

    python bench_vllm.py [--model qwen3-0.6b] [--num-seqs 256] [--input-len 100 1024] [--output-len 100 1024]
"""
import argparse
import time

import torch

from bench import header, make_workload, resolve_model, sync
from nanovllm.weights.synthetic import SHAPES


def run_vllm(model, prompts, out_lens):
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model, max_model_len=max(map(len, prompts)) + max(out_lens))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i) for i, n in enumerate(out_lens)]
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return "vLLM", time.perf_counter() - start, sum(out_lens)


def run_hf_continuous(model, prompts, out_lens, dtype, device):
    """HF's generate_batch takes one max_new_tokens for all requests: the workload's mean, EOS ignored."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="paged|sdpa").to(device).eval()
    n = round(sum(out_lens) / len(out_lens))
    config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=0.6, top_k=0,
                              eos_token_id=None, pad_token_id=0)
    sync(device)
    start = time.perf_counter()
    results = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return "HF transformers generate_batch (continuous batching)", seconds, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a HF model directory, or a synthetic shape: " + ", ".join(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.mode = "throughput (peer)"
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = resolve_model(args.model, dtype)
    from transformers import AutoConfig

    prompts, out_lens = make_workload(args, AutoConfig.from_pretrained(model).vocab_size)
    try:
        name, seconds, tokens = run_vllm(model, prompts, out_lens)
    except ImportError:
        name, seconds, tokens = run_hf_continuous(model, prompts, out_lens, dtype, args.device)
    print(header(args, dtype, f"{args.num_seqs} seqs, input U{args.input_len}, output U{args.output_len}"))
    print("| engine | output tokens | seconds | output tok/s |\n|---|---|---|---|")
    print(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:.0f} |")


if __name__ == "__main__":
    main()
