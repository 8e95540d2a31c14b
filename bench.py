"""Offline throughput on nano-vLLM's workload (random token prompts, ignore_eos, temperature 0.6), and the
single-stream decode and batched prefill figures, each against a physical limit measured in the same run.

    python bench.py                         # GPU: 256 seqs, in/out U[100,1024], Qwen3-0.6B shape, bf16
    python bench.py --mode decode1 --model llama3-8b      # bs=1 decode vs the weight-read bound
    python bench.py --mode prefill --model llama3-8b      # 8 x 4096-token prompts vs bf16 matmul peak
    python bench.py --model llama3-8b --quantization fp8   # a 16-bit checkpoint quantized at load
    python bench.py --mode sweep --plot docs/decode_vs_batch.png   # decode tok/s against batch size
    python bench.py --device cpu --model smollm2 --num-seqs 32 --input-len 100 300 --output-len 128 128 --hf
"""
import argparse
import datetime
import os
import platform
import random
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.benchmarking import (
    count_bytes_read,
    kv_bytes_per_token,
    make_workload,
    measure_hbm_bandwidth,
    resolve_model,
    weight_bytes_per_step,
)
from nanovllm.weights.synthetic import SHAPES


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bf16_flops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 20 / (time.perf_counter() - start)


def timed_generate(llm, prompts, params, device):
    sync(device)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    return time.perf_counter() - start, outs


def make_llm(args, model, dtype, **settings) -> LLM:
    """The engine of every mode: the model's own max_model_len and the engine's max_num_seqs unless --max-model-len
    or --max-num-seqs say otherwise (users' defaults: the figures are the ones they get)."""
    llm = LLM(model, device=args.device, dtype=dtype, attention_backend=args.attention_backend,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, quantization=args.quantization,
              tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
              disable_custom_all_reduce=args.disable_custom_all_reduce, load_format=args.load_format,
              cpu_offload_gb=args.cpu_offload_gb, **settings)
    engine = llm.llm_engine
    args.engine_used = (f"quantization {engine.model_config.quantization}, "
                        f"attention backend {engine.model_runner.backend.name}, max_model_len "
                        f"{engine.model_config.max_model_len}, max_num_seqs {engine.config.max_num_seqs}"
                        + (f", tensor parallel {args.tensor_parallel_size}"
                           f"{' (NCCL only)' if args.disable_custom_all_reduce else ''}"
                           if args.tensor_parallel_size > 1 else "")
                        + (", random weights drawn at load (load_format dummy)" if args.load_format == "dummy" else ""))
    return llm


def run_ours(args, model, prompts, out_lens, dtype):
    llm = make_llm(args, model, dtype, enforce_eager=args.enforce_eager,
                   max_num_batched_tokens=args.max_num_batched_tokens)
    timed_generate(llm, prompts[:2], SamplingParams(max_tokens=4), args.device)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i, detokenize=False)
              for i, n in enumerate(out_lens)]
    bytes_read = count_bytes_read(llm.llm_engine.model_runner)
    runs = []  # (seconds, bytes read) of each timed run
    for _ in range(args.repeat):
        assert llm.reset_prefix_cache()  # every run computes every prompt token
        before = bytes_read[0]
        seconds, outs = timed_generate(llm, prompts, params, args.device)
        assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
        runs.append((seconds, bytes_read[0] - before))
    return runs, llm


def run_hf(args, model, prompts, out_lens, dtype):
    """HF transformers' generate, one left-padded batch (every row generates the workload's longest output)."""
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
    return time.perf_counter() - start, len(prompts) * n


def device_name(args) -> str:
    if args.device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"CPU {platform.machine()}, {torch.get_num_threads()} threads"


def header(args, dtype, extra=""):
    return (f"\n| device | date | model | dtype | mode | config |\n|---|---|---|---|---|---|\n"
            f"| {device_name(args)} | {datetime.date.today()} | {args.model} | {str(dtype).removeprefix('torch.')} "
            f"| {args.mode} | {extra}; {getattr(args, 'engine_used', '?')} |\n")


def throughput_row(engine: str, tokens: int, seconds: float, bytes_read: int, bw: float | None) -> str:
    roofline = f"{bytes_read / bw / seconds:.0%} of HBM roofline ({bytes_read / 1e9:.0f} GB read, {bw / 1e12:.2f} TB/s)" \
        if bw else ""
    return f"| {engine} | {tokens} | {seconds:.2f} | {tokens / seconds:.0f} | 1.00x | {roofline} |"


def bench_throughput(args, model, dtype, vocab):
    prompts, out_lens = make_workload(args, vocab)
    total_out = sum(out_lens)
    runs, _ = run_ours(args, model, prompts, out_lens, dtype)
    print(header(args, dtype, f"{args.num_seqs} seqs, input U{args.input_len} ({sum(map(len, prompts))} tok), "
                              f"output U{args.output_len} ({total_out} tok), eager={args.enforce_eager}, "
                              f"max_num_batched_tokens={args.max_num_batched_tokens or 'default'}"))
    print("| engine | output tokens | seconds | output tok/s | vs nanovllm | roofline |\n|---|---|---|---|---|---|")
    bw = measure_hbm_bandwidth() if args.device.startswith("cuda") else None
    for i, (seconds, bytes_read) in enumerate(runs if len(runs) > 1 else []):
        print(throughput_row(f"nanovllm run {i + 1}/{len(runs)}", total_out, seconds, bytes_read, bw))
    seconds, bytes_read = sorted(runs)[len(runs) // 2]  # the median run, last
    print(throughput_row("nanovllm" + (f" median of {len(runs)}" if len(runs) > 1 else ""), total_out, seconds,
                         bytes_read, bw))
    if args.hf:
        hf_seconds, hf_tokens = run_hf(args, model, prompts, out_lens, dtype)
        ratio = (total_out / seconds) / (hf_tokens / hf_seconds)
        print(f"| HF transformers generate (padded batch) | {hf_tokens} | {hf_seconds:.2f} | "
              f"{hf_tokens / hf_seconds:.0f} | {1 / ratio:.2f}x | |")


def bench_decode1(args, model, dtype):
    """One sequence, 512 prompt tokens, 256 new tokens: tok/s against weights + KV bytes / HBM bandwidth."""
    llm = make_llm(args, model, dtype, enforce_eager=args.enforce_eager, enable_prefix_caching=False,  # every run
                   max_num_batched_tokens=args.max_num_batched_tokens)  # below does the same full prefill
    prompt = [random.Random(0).randint(100, 20000) for _ in range(512)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=256, detokenize=False)
    for max_tokens in (8, 1):  # warm-up: every kernel the timed runs use is compiled here
        timed_generate(llm, [prompt], SamplingParams(max_tokens=max_tokens, detokenize=False), args.device)
    runs = []  # decode tok/s of each timed run: the prefill alone, then prefill + 255 decode steps
    for _ in range(args.repeat):
        prefill, _ = timed_generate(llm, [prompt], SamplingParams(max_tokens=1, detokenize=False), args.device)
        seconds, _ = timed_generate(llm, [prompt], params, args.device)
        runs.append(255 / (seconds - prefill))
    decode_tps = sorted(runs)[len(runs) // 2]
    runner = llm.llm_engine.model_runner
    bw, weight_bytes = measure_hbm_bandwidth(), weight_bytes_per_step(runner.model, batch=1)
    state_bytes = 2 * runner.plan.kv.slot_bytes  # linear-attention layers read and write their state slots
    bound = bw / (weight_bytes + kv_bytes_per_token(runner) * 640 + state_bytes)
    print(header(args, dtype, f"bs=1, prompt 512, 256 new tokens, greedy, median of {args.repeat} run(s)"))
    print("| decode tok/s | weight-read bound tok/s | ratio | weights GB | HBM TB/s | runs |\n|---|---|---|---|---|---|")
    print(f"| {decode_tps:.0f} | {bound:.0f} | {decode_tps / bound:.0%} | {weight_bytes / 1e9:.2f} | {bw / 1e12:.2f} "
          f"| {' / '.join(f'{r:.0f}' for r in runs)} |")


def bench_sweep(args, model, dtype):
    """Decode tok/s against batch size (prompts of 512 tokens, 128 new tokens, greedy), each beside its HBM
    bound (weights + that batch's KV read once a step); with --plot, also a PNG of both curves."""
    sizes = args.batch_sizes
    if max(sizes) > (args.max_num_seqs or 256):
        raise SystemExit(f"--batch-sizes up to {max(sizes)} need --max-num-seqs {max(sizes)} or more")
    llm = make_llm(args, model, dtype, enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    bw = measure_hbm_bandwidth() if args.device.startswith("cuda") else None
    rng = random.Random(args.seed)
    vocab = llm.llm_engine.model_config.vocab_size
    greedy = dict(temperature=0, ignore_eos=True, detokenize=False)
    timed_generate(llm, [[rng.randint(100, vocab - 1) for _ in range(512)]], SamplingParams(max_tokens=8, **greedy),
                   args.device)
    rows = []
    for bs in sizes:
        prompts = [[rng.randint(100, vocab - 1) for _ in range(512)] for _ in range(bs)]
        timed_generate(llm, prompts, SamplingParams(max_tokens=2, **greedy), args.device)  # warm-up at this size
        prefill, _ = timed_generate(llm, prompts, SamplingParams(max_tokens=1, **greedy), args.device)
        seconds, _ = timed_generate(llm, prompts, SamplingParams(max_tokens=128, **greedy), args.device)
        tps = bs * 127 / (seconds - prefill)
        mean_context = 512 + 64  # tokens of KV read a step, averaged over the 128 new tokens
        bound = bs * bw / (weight_bytes_per_step(runner.model, bs) + bs * mean_context * kv_bytes_per_token(runner)) \
            if bw else None
        rows.append((bs, tps, bound))
    print(header(args, dtype, "decode tok/s against batch size: 512-token prompts, 128 new tokens, greedy"))
    print("| batch size | decode tok/s | HBM bound tok/s | ratio |\n|---|---|---|---|")
    for bs, tps, bound in rows:
        print(f"| {bs} | {tps:,.0f} | {f'{bound:,.0f}' if bound else ''} | {f'{tps / bound:.0%}' if bound else ''} |")
    if args.plot:
        curves = {"nanovllm decode": ([r[0] for r in rows], [r[1] for r in rows], "o-")}
        if bw:
            curves["HBM bound (weights + KV)"] = ([r[0] for r in rows], [r[2] for r in rows], "--")
        plot_against_batch(args.plot, curves, f"{os.path.basename(str(args.model))} "
                           f"{str(dtype).removeprefix('torch.')}, {device_name(args)}")


def plot_against_batch(path: str, curves: dict, title: str):
    """A PNG of output tok/s against batch size, log-log: curves maps a label to (batch sizes, tok/s, line style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys, style) in curves.items():
        ax.plot(xs, ys, style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="output tok/s", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def bench_prefill(args, model, dtype, hf_config):
    """8 prompts of 4096 tokens, one token each: prefill tok/s against the measured bf16 matmul peak."""
    llm = make_llm(args, model, dtype, max_num_batched_tokens=8192, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randint(100, 20000) for _ in range(4096)] for _ in range(8)]
    params = SamplingParams(max_tokens=1, detokenize=False)
    timed_generate(llm, prompts[:2], params, args.device)
    seconds, _ = timed_generate(llm, prompts, params, args.device)
    tps = 8 * 4096 / seconds
    runner = llm.llm_engine.model_runner
    layer_params = sum(p.numel() for p in runner.model.model.layers.parameters())
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn_flops = 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * 4096  # causal: half of 4 * L * H * D
    # every token goes through the layers; the LM head runs on each prompt's last token only
    flops_per_token = 2 * layer_params + attn_flops + 2 * c.vocab_size * c.hidden_size / 4096
    peak = measure_bf16_flops()
    print(header(args, dtype, "8 x 4096-token prompts, max_num_batched_tokens 8192"))
    print("| prefill tok/s | TFLOP/s achieved | bf16 matmul peak TFLOP/s | ratio |\n|---|---|---|---|")
    print(f"| {tps:.0f} | {tps * flops_per_token / 1e12:.0f} | {peak / 1e12:.0f} | {tps * flops_per_token / peak:.0%} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="throughput", choices=["throughput", "decode1", "prefill", "sweep"])
    ap.add_argument("--model", default="qwen3-0.6b", help="a path, 'smollm2', a synthetic shape (" + ", ".join(SHAPES)
                    + "), or a synthetic GGUF: SHAPE:TYPE, e.g. llama3-8b:Q4_K")
    ap.add_argument("--tokenizer-gguf", default=os.environ.get("NANOVLLM_TOKENIZER_GGUF"),
                    help="synthetic GGUF: the GGUF whose tokenizer to copy (default: $NANOVLLM_TOKENIZER_GGUF, else "
                    "the bundled model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (256)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="throughput and decode1 modes (decode1: "
                    "fewer prefill graphs to capture; at least its 512-token prompt); default: the engine's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs on one engine: throughput mode (the prefix "
                    "cache reset before each; the median run is the last row) and decode1 (the median is reported)")
    ap.add_argument("--quantization", default=None, help="gguf, none, fp8, int8 or int4; default: the engine's")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cpu-offload-gb", type=float, default=0, help="GiB of weights in host memory, streamed in "
                    "(a mixture: experts)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights drawn at load (a synthetic shape's "
                    "config alone is written; no weight file is read)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model's heads and rows split over")
    ap.add_argument("--disable-custom-all-reduce", action="store_true", help="tensor parallel: NCCL for every "
                    "all-reduce (vLLM's flag)")
    ap.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas, a GPU each (the roofline "
                    "column then counts replica 0's bytes only)")
    ap.add_argument("--attention-backend", default=None, help="torch, triton or flash_attn; default: the engine's")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256], help="sweep mode")
    ap.add_argument("--plot", default=None, help="sweep mode: write a PNG of tok/s against batch size here")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers' batched generate")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.hf and args.load_format == "dummy":
        ap.error("--hf reads the weights from files; --load-format dummy writes none")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if args.device == "cpu" else torch.bfloat16)
    model = resolve_model(args.model, dtype, args.tokenizer_gguf, args.load_format)
    if args.load_format == "dummy" and ":" in args.model:  # SHAPE:Q4_K: the experts drawn as blocks at load
        args.quantization = args.quantization or "gguf"
    from nanovllm.weights.model_files import load_model_config

    hf_config, _ = load_model_config(model, args.load_format)
    if args.mode == "decode1":
        bench_decode1(args, model, dtype)
    elif args.mode == "sweep":
        bench_sweep(args, model, dtype)
    elif args.mode == "prefill":
        bench_prefill(args, model, dtype, hf_config)
    else:
        bench_throughput(args, model, dtype, hf_config.vocab_size)


if __name__ == "__main__":
    main()
