"""KV cache beyond the GPU (issue #42), measured on CUDA.

    python bench_offload.py copies   # KV blocks between the GPU cache and a pinned host pool
    python bench_offload.py long [--model qwen3-0.6b] [--prompt-len 8192 32768] [--gpu-tokens 2048] [--num-prompts 4]
    python bench_offload.py weights [--model llama3-8b] [--batch-sizes 1 64] [--plot curve.png]  # streamed weights
    python bench_offload.py batch --prompt-len 1024 --output-len 2048 --batch-sizes 16 [--kv-multiple 3]  # swap vs recompute
    python bench_offload.py experts --model qwen3.5-397b-a17b:Q4_K --load-format dummy --offload-gb 140 [--batch-sizes 1 64]

copies: whole blocks (every layer, K and V) of a Llama-3-8B-shape KV cache (32 layers, 8 KV heads of 128, bf16) moved
by sgDMA (comm/sgdma.py), by its torch twin (gather, one copy, scatter) and as one contiguous copy of the same bytes,
host to device and back, against the pinned host-to-device bandwidth of a contiguous 1 GiB copy in the same run.

long: --num-prompts prompts of --prompt-len tokens and --output-len greedy tokens each, with every block on the GPU
and with the GPU capped at --gpu-tokens of KV (the rest offloaded to the host pool; the prompts decode together):
prefill and output tok/s, each against the resident run, and decode against its bound (the offloaded KV bytes a step
over the pinned H2D bandwidth).
Prompts past the model's context stretch it by YaRN (config.json's rope_scaling).

weights: decode tok/s at each batch size with the decoder layers' weights resident, and with 25% / 50% / 75% of them
in pinned host memory (cpu_offload_gb) or 25% on disk (disk_offload_gb), each against the resident run and against
its bound: the streamed bytes a step over each tier's bandwidth (pinned H2D; the disk's, read back as the streamer
reads it, O_DIRECT where the file system allows). --model llama3-8b:Q4_K streams GGUF layers kept quantized.

batch: --batch-sizes' last value of --prompt-len prompts whose KV is --kv-multiple times the GPU's: output tok/s with
swap preemption (a host pool), with recompute preemption, and with the GPU holding it all.

experts: a mixture with --offload-gb GiB of its experts in pinned host memory (cpu_offload_gb; SHAPE:Q4_K with
--load-format dummy draws them as Q4_K blocks at load): decode tok/s at each batch size against its bound, the
experts a decode step loaded (counted) over the pinned H2D bandwidth."""
import argparse
import datetime
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from bench import plot_against_batch, resolve_model, timed_generate
from nanovllm import LLM, SamplingParams
from nanovllm.comm import sgdma
from nanovllm.streaming.layer_file import aligned
from nanovllm.streaming.layer_streamer import streamed_bytes
from nanovllm.utils.benchmarking import kv_bytes_per_token

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def seconds(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def free_gpu_memory():
    """Give back what the engine just dropped held (its model and a streamer's hooks hold each other: a cycle)."""
    gc.collect()
    torch.cuda.empty_cache()


def pinned_h2d_bandwidth() -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    # the best of several copies: a single figure has come out 20% low on a machine whose copies ran at full speed
    return host.numel() / min(seconds(lambda: device.copy_(host, non_blocking=True), repeat=1) for _ in range(8))


def kv_cache(blocks: int, block_size: int, host: bool) -> torch.Tensor:
    shape = (2, LAYERS, blocks, block_size, KV_HEADS, HEAD_DIM)
    if host:
        return torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda")


def bench_copies(args):
    bound = pinned_h2d_bandwidth()
    print(f"\n| device | date | config |\n|---|---|---|\n| {torch.cuda.get_device_name()} | {datetime.date.today()} | "
          f"Llama-3-8B KV ({LAYERS} layers, {KV_HEADS} KV heads of {HEAD_DIM}, bf16); pinned host pool; "
          f"pinned H2D of 1 GiB contiguous: {bound / 1e9:.1f} GB/s; sgDMA: {sgdma.why_off(torch.device('cuda')) or 'on'} |\n")
    print("| block size | blocks moved | block ids | direction | MB | sgDMA GB/s | torch twin GB/s | contiguous GB/s | "
          "sgDMA / pinned H2D |\n|---|---|---|---|---|---|---|---|---|")
    for block_size, count in ((16, 64), (16, 512), (256, 32)):
        device_blocks, host_blocks = 4 * count, 2 * count
        gpu, pool = kv_cache(device_blocks, block_size, False), kv_cache(host_blocks, block_size, True)
        nbytes = count * gpu[:, :, 0].numel() * gpu.element_size()
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for ids in ("scattered", "consecutive"):
            if ids == "scattered":
                gpu_ids = torch.randperm(device_blocks)[:count].tolist()
                pool_ids = torch.randperm(host_blocks)[:count].tolist()
            else:
                gpu_ids, pool_ids = list(range(count, 2 * count)), list(range(count))
            for direction, (src, dst, s, d, flat) in (
                    ("H2D", (pool, gpu, pool_ids, gpu_ids, (flat_gpu, flat_host))),
                    ("D2H", (gpu, pool, gpu_ids, pool_ids, (flat_host, flat_gpu)))):
                t_sg = seconds(lambda: sgdma.copy_blocks(src, dst, s, d))
                t_torch = seconds(lambda: sgdma.torch_copy_blocks(src, dst, s, d), repeat=2)
                t_flat = seconds(lambda: flat[0].copy_(flat[1], non_blocking=True))
                print(f"| {block_size} | {count} | {ids} | {direction} | {nbytes / 1e6:,.0f} | {nbytes / t_sg / 1e9:.1f} | "
                      f"{nbytes / t_torch / 1e9:.1f} | {nbytes / t_flat / 1e9:.1f} | {nbytes / t_sg / bound:.0%} |",
                      flush=True)
        del gpu, pool, flat_host, flat_gpu
        free_gpu_memory()


def generate_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
    return timed_generate(llm, prompts, params, "cuda")[0]


def bench_long(args):
    model = resolve_model(args.model, torch.bfloat16)
    bw = pinned_h2d_bandwidth()
    print(f"\n| device | date | config |\n|---|---|---|\n| {torch.cuda.get_device_name()} | {datetime.date.today()} | "
          f"{args.model}, bf16, {args.num_prompts} prompt(s) + {args.output_len} greedy tokens each; offloaded: GPU KV capped at "
          f"{args.gpu_tokens:,} tokens; pinned H2D {bw / 1e9:.1f} GB/s |\n")
    print("| prompts | run | prefill tok/s | vs resident | decode out tok/s | vs resident | decode bound (offloaded KV / "
          "H2D) |\n|---|---|---|---|---|---|---|")
    stretch_context(model, max(args.prompt_len) + args.output_len + 16)
    for prompt_len in args.prompt_len:
        long_rows(args, model, prompt_len, bw)


def kv_bytes_of(model: str) -> int:
    """K and V of one token across every layer, in bf16, from config.json."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 2


def stretch_context(model: str, max_len: int):
    """Where the config's context is shorter than max_len, YaRN stretches it (config.json's rope_scaling, as Qwen's
    docs set it for 128K contexts)."""
    path = Path(model) / "config.json"
    config = json.loads(path.read_text())
    native = config["max_position_embeddings"]
    if max_len > native and not config.get("rope_scaling"):
        config["rope_scaling"] = {"rope_type": "yarn", "factor": float(math.ceil(max_len / native)),
                                  "original_max_position_embeddings": native}
        path.write_text(json.dumps(config))


def long_rows(args, model: str, prompt_len: int, bw: float):
    n = args.num_prompts
    prompts = [[random.Random(i).randint(100, 500) for _ in range(prompt_len)] for i in range(n)]  # in every vocabulary
    max_len = prompt_len + args.output_len + 16
    figures = {}
    for name in ("resident", "offloaded"):
        block_size = 16
        kw = dict(num_gpu_blocks_override=args.gpu_tokens // block_size,
                  kv_offloading_size=1.05 * n * max_len * kv_bytes_of(model) / (1 << 30)) if name == "offloaded" else {}
        llm = LLM(model, max_model_len=max_len, block_size=block_size, enable_prefix_caching=False, **kw)
        generate_seconds(llm, [p[:3 * args.gpu_tokens] for p in prompts], 2)  # warm-up, offloaded steps' kernels too
        prefill = generate_seconds(llm, prompts, 1)
        decode = n * (args.output_len - 1) / (generate_seconds(llm, prompts, args.output_len) - prefill)
        runner = llm.llm_engine.model_runner
        path = "a layer at a time" if runner.layer_major is not None and runner.layer_major.runs else "chunked"
        figures[name] = (n * prompt_len / prefill, decode, kv_bytes_per_token(runner), path)
        del llm, runner
        free_gpu_memory()
    offloaded_tokens = n * (prompt_len + args.output_len // 2) - args.gpu_tokens  # over the batch, mid-decode
    bound = n * bw / (offloaded_tokens * figures["offloaded"][2])  # a step streams them all once
    (pre_r, dec_r, *_), (pre_o, dec_o, _, path) = figures["resident"], figures["offloaded"]
    label = f"{n} x {prompt_len:,}" if n > 1 else f"{prompt_len:,}"
    print(f"| {label} | resident | {pre_r:,.0f} | 1.00x | {dec_r:.1f} | 1.00x | |")
    print(f"| {label} | offloaded, prefill {path} | {pre_o:,.0f} | {pre_o / pre_r:.2f}x | {dec_o:.1f} | "
          f"{dec_o / dec_r:.2f}x | {bound:.1f} tok/s ({dec_o / bound:.0%}) |", flush=True)


def bench_batch(args):
    """A batch whose KV is --kv-multiple times the GPU's: swap preemption (a host pool) against recompute, and
    against the run where the GPU holds it all."""
    model = resolve_model(args.model, torch.bfloat16)
    prompt_len, batch = args.prompt_len[0], args.batch_sizes[-1]
    prompts = [[random.Random(i).randint(100, 500) for _ in range(prompt_len)] for i in range(batch)]
    max_len = prompt_len + args.output_len
    blocks_needed = batch * -(-max_len // 16)
    bandwidth = pinned_h2d_bandwidth()
    rows = []
    for name, kw in (("resident", {}),
                     ("recompute", dict(num_gpu_blocks_override=int(blocks_needed / args.kv_multiple))),
                     ("swap", dict(num_gpu_blocks_override=int(blocks_needed / args.kv_multiple),
                                   kv_offloading_size=blocks_needed * 16 * (256 << 10) / (1 << 30),
                                   preemption_mode="swap"))):
        llm = LLM(model, max_model_len=max_len, block_size=16, enable_prefix_caching=False, **kw)
        generate_seconds(llm, prompts[:2], 2)  # warm-up
        pool = llm.llm_engine.model_runner.host_pool
        copied_before = pool.copied_blocks if pool else 0
        seconds = generate_seconds(llm, prompts, args.output_len)
        scheduler = llm.llm_engine.scheduler
        copied = ((pool.copied_blocks - copied_before) * pool.block_bytes) if pool else 0
        link = copied / bandwidth  # the copies' time at the pinned host-to-device bandwidth
        rows.append((name, batch * args.output_len / seconds, seconds, scheduler.num_preemptions, scheduler.num_swaps,
                     copied, link))
        del llm, scheduler, pool
        free_gpu_memory()
    print(f"\n| device | date | config |\n|---|---|---|\n| {torch.cuda.get_device_name()} | {datetime.date.today()} | "
          f"{args.model}, bf16, {batch} prompts of {prompt_len:,} tokens + {args.output_len} greedy tokens; GPU KV "
          f"capped at 1/{args.kv_multiple:g} of the batch's |\n")
    print("| run | output tok/s | vs resident | vs recompute | preemptions | of them swapped | host copies | their time "
          "at the link, of the run |\n|---|---|---|---|---|---|---|---|")
    for name, tps, seconds, preemptions, swaps, copied, link in rows:
        print(f"| {name} | {tps:,.1f} | {tps / rows[0][1]:.2f}x | {tps / rows[1][1]:.2f}x | {preemptions} | {swaps} | "
              f"{copied / 1e9:.1f} GB | {f'{link:.2f} s, {link / seconds:.0%}' if copied else ''} |")


def decode_counted(llm: LLM, batch: int, output_len: int, count) -> tuple[float, int]:
    """(decode tok/s, what count() gained over the decode steps) of `batch` 128-token prompts decoding output_len
    tokens: a prefill-only run's time and count taken out of the whole run's."""
    prompts = [[random.Random(i).randint(100, 500) for _ in range(128)] for i in range(batch)]
    generate_seconds(llm, prompts, 2)  # warm-up
    start = count()
    whole = generate_seconds(llm, prompts, output_len)
    after_whole = count()
    prefill = generate_seconds(llm, prompts, 1)
    return batch * (output_len - 1) / (whole - prefill), (after_whole - start) - (count() - after_whole)


def decode_tok_s(llm: LLM, batch: int, output_len: int) -> tuple[float, float]:
    """Output tok/s of `batch` 128-token prompts decoding output_len tokens, the prefill's time taken out, and the
    sequences a decode step carried on average (fewer than `batch` where the KV cache holds fewer at a time)."""
    runner, steps = llm.llm_engine.model_runner, [0]  # steps launched, one pass over the layers each
    launch = runner.launch  # counted here, not by a layer hook: a CUDA graph's replay runs no hooks

    def counted_launch(*args, **kwargs):
        steps[0] += 1
        return launch(*args, **kwargs)

    runner.launch = counted_launch
    tok_s, decode_steps = decode_counted(llm, batch, output_len, lambda: steps[0])
    del runner.launch
    return tok_s, batch * (output_len - 1) / decode_steps


def disk_bandwidth(streamer) -> float:
    """Bytes a second of reading the streamer's disk layers back as it does (kvikio into a slot, or positional reads
    with O_DIRECT where allowed), the best of three passes."""
    layers, passes = sorted(streamer.disk), []
    for _ in range(3):
        start = time.perf_counter()
        for index in layers:
            if streamer.kvikio is not None:
                offset, nbytes = streamer.layer_file.places[index]
                streamer.kvikio.read(offset, aligned(nbytes), streamer.slots[0]).wait()
            else:
                streamer.layer_file.read_into(index, streamer.staging[0])
        passes.append(time.perf_counter() - start)
    return sum(streamer.sizes[i] for i in layers) / min(passes)


def disk_reads(streamer) -> str:
    if streamer.kvikio is not None:
        return "kvikio" if streamer.kvikio.gds else "kvikio compatibility mode"
    return f"positional reads, O_DIRECT {'on' if streamer.layer_file.direct else 'off'}"


def file_layer_bytes(model: str) -> int:
    """The decoder layers' bytes as the file holds them (GGUF blocks kept quantized, or safetensors), for placements
    run without the resident run that measures them."""
    if model.endswith(".gguf"):
        from nanovllm.weights.gguf_loader import open_gguf

        return sum(int(t.n_bytes) for t in open_gguf(model).tensors if t.name.startswith("blk."))
    from safetensors import safe_open

    total = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if ".layers." in name:
                    piece = f.get_slice(name)
                    total += math.prod(piece.get_shape()) * {"BF16": 2, "F16": 2, "F32": 4}[piece.get_dtype()]
    return total


def weights_rows(args, model: str, layers_bytes: int | None, bw: float, resident: dict, host: float,
                 disk: float) -> tuple:
    """The placement's rows (and curve points), and the decoder layers' bytes (measured here on a resident run)."""
    gib = (layers_bytes or 0) / (1 << 30)
    utilization = 0.5 if args.vram_gb is None else args.vram_gb * (1 << 30) / torch.cuda.mem_get_info()[1]
    llm = LLM(model, max_model_len=1024, enable_prefix_caching=False, max_num_seqs=max(args.batch_sizes),
              gpu_memory_utilization=0.9 if host == disk == 0 else utilization,  # resident: the whole GPU
              cpu_offload_gb=host * gib, disk_offload_gb=disk * gib)
    streamer, rows, curve = llm.llm_engine.model_runner.streamer, [], []
    if streamer is None:
        layers_bytes = sum(streamed_bytes(list(llm.llm_engine.model_runner.model.model.layers)))
    disk_bytes = sum(streamer.sizes[i] for i in streamer.disk) if streamer and streamer.disk else 0
    host_bytes = (sum(streamer.sizes.values()) if streamer else 0) - disk_bytes
    disk_bw = disk_bandwidth(streamer) if disk_bytes else None
    step_bound = host_bytes / bw + (disk_bytes / disk_bw if disk_bytes else 0)  # seconds a step, one sequence or many
    where = f"{host:.0%} host ({host_bytes / 1e9:.1f} GB)" + (f", {disk:.0%} disk ({disk_bytes / 1e9:.1f} GB at "
                                                               f"{disk_bw / 1e9:.2f} GB/s, {disk_reads(streamer)})"
                                                               if disk_bytes else "")
    for batch in args.batch_sizes:
        tps, per_step = decode_tok_s(llm, batch, min(args.output_len, 8) if disk_bytes else args.output_len)  # disk: slow
        if not host and not disk:
            resident[batch] = tps
        bound = f"{per_step / step_bound:,.1f} tok/s ({tps * step_bound / per_step:.0%})" if step_bound else ""
        versus = f"{tps / resident[batch]:.2f}x" if batch in resident else "not run"
        rows.append(f"| {where} | {batch} | {per_step:.0f} | {tps:,.1f} | {versus} | {bound} |")
        curve.append((batch, tps, per_step / step_bound if step_bound else None))
    del llm, streamer
    free_gpu_memory()
    return rows, where.split(" (")[0] if host or disk else "resident", curve, layers_bytes


def bench_weights(args):
    model = resolve_model(args.model, torch.bfloat16, os.environ.get("NANOVLLM_TOKENIZER_GGUF"))
    bw = pinned_h2d_bandwidth()
    if (0, 0) in args.placements[1:]:
        raise SystemExit("weights mode: the resident run (0:0), the others' reference, comes first")
    rows, resident, curves = [], {}, {}
    layers_bytes = None if args.placements[0] == (0, 0) else file_layer_bytes(model)
    for host, disk in args.placements:
        placement_rows, label, curve, layers_bytes = weights_rows(args, model, layers_bytes, bw, resident, host, disk)
        rows += placement_rows
        for row in placement_rows:  # as each placement ends: a run cut short keeps them (the table comes last)
            print(f"measured: {row}", file=sys.stderr, flush=True)
        curves[label] = ([c[0] for c in curve], [c[1] for c in curve], "o-")
        if curve[0][2]:
            curves[f"{label}: bound"] = ([c[0] for c in curve], [c[2] for c in curve], "--")
    print(f"\n| device | date | config |\n|---|---|---|\n| {torch.cuda.get_device_name()} | {datetime.date.today()} | "
          f"{args.model} ({layers_bytes / 1e9:.1f} GB of decoder layers), 128-token prompts, {args.output_len} greedy "
          f"tokens{f'; streamed runs in {args.vram_gb:g} GiB of GPU memory' if args.vram_gb else ''}; pinned H2D "
          f"{bw / 1e9:.1f} GB/s |\n")
    print("| decoder weights streamed from | batch | sequences a decode step (the KV cache's limit) | decode tok/s | "
          "vs resident | bound (sequences a step / a step's streamed bytes over each tier's bandwidth) |\n"
          "|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.plot:
        plot_against_batch(args.plot, curves, f"{args.model}, weights streamed, {torch.cuda.get_device_name()}")


def bench_experts(args):
    model = resolve_model(args.model, torch.bfloat16, os.environ.get("NANOVLLM_TOKENIZER_GGUF"), args.load_format)
    quantization = "gguf" if args.load_format == "dummy" and ":" in args.model else None
    bw = pinned_h2d_bandwidth()
    print(f"\n| device | date | config |\n|---|---|---|\n| {torch.cuda.get_device_name()} | {datetime.date.today()} | "
          f"{args.model}, 128-token prompts, {args.output_len} greedy tokens; pinned H2D {bw / 1e9:.1f} GB/s |\n")
    print("| experts in host memory | batch | decode tok/s | experts loaded a step | their bytes a step | bound (batch / "
          "a step's bytes over H2D) | vs bound |\n|---|---|---|---|---|---|---|", flush=True)
    for gb in args.offload_gb:
        llm = LLM(model, load_format=args.load_format, quantization=quantization, cpu_offload_gb=gb,
                  max_model_len=128 + args.output_len + 16, enable_prefix_caching=False)
        streamer = llm.llm_engine.model_runner.streamer
        expert_bytes = streamer.placement.expert_bytes
        for batch in args.batch_sizes:
            tok_s, loaded = decode_counted(llm, batch, args.output_len, lambda s=streamer: s.num_loaded)
            loaded /= args.output_len - 1  # a decode step
            bound = batch * bw / (loaded * expert_bytes) if loaded else float("inf")
            print(f"| {gb:g} GiB ({streamer.describe(torch.device('cuda'))}) | {batch} | {tok_s:.1f} | {loaded:.0f} | "
                  f"{loaded * expert_bytes / 1e9:.2f} GB | {bound:.1f} tok/s | {tok_s / bound:.0%} |", flush=True)
        del llm, streamer
        free_gpu_memory()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["copies", "long", "weights", "batch", "experts"])
    ap.add_argument("--offload-gb", type=float, nargs="+", default=[140], help="experts mode: cpu_offload_gb runs")
    ap.add_argument("--load-format", default="auto", help="experts mode: dummy draws the weights at load")
    ap.add_argument("--kv-multiple", type=float, default=3.0, help="batch mode: the batch's KV over the GPU's")
    ap.add_argument("--plot", default=None, help="weights mode: a PNG of decode tok/s against batch size here")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[8192], help="long mode: one run each")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=1, help="long mode: prompts that decode together")
    ap.add_argument("--gpu-tokens", type=int, default=2048)
    ap.add_argument("--vram-gb", type=float, default=None, help="weights mode: GiB of GPU memory the streamed runs "
                    "may use (a smaller card's; default: half the GPU); resident runs take the whole GPU")
    ap.add_argument("--placements", type=lambda v: tuple(map(float, v.split(":"))), nargs="+",
                    default=[(0, 0), (0.25, 0), (0.5, 0), (0.75, 0), (0, 0.25)],
                    help="weights mode: HOST:DISK shares of the decoder layers streamed from each tier")
    args = ap.parse_args()
    {"copies": bench_copies, "long": bench_long, "weights": bench_weights, "batch": bench_batch,
     "experts": bench_experts}[args.mode](args)


if __name__ == "__main__":
    main()
