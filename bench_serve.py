"""`nanovllm serve` against LLM.generate on the same engine: nano-vLLM's workload sent as concurrent streaming
completions (token-id prompts, ignore_eos, temperature 0.6) through the OpenAI route, its output tok/s against the
offline run's on the same engine settings; and the time to first token at 1, 16 and 64 concurrent requests. The server
runs its engine in a process of its own (as `nanovllm serve` does), the clients in --client-processes others, as
users' would; the offline run goes first, in a process of its own too (one engine holds the GPU at a time). A line
after the table says where the served run's time went: the engine's steps against the offline run's, and each
process's CPU seconds.

    python bench_serve.py                                # GPU: 256 requests, Qwen3-0.6B shape
    python bench_serve.py --device cpu --model tiny-llama --num-seqs 8 --input-len 10 20 --output-len 8 16
"""
import argparse
import asyncio
import datetime
import json
import multiprocessing
import socket
import threading
import time

import httpx
import torch
import uvicorn
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai.engine_client import EngineClient
from nanovllm.entrypoints.openai.server import build_app
from nanovllm.utils.benchmarking import make_workload, resolve_model


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens received) of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=None) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first or 0.0, tokens


async def _burst(url: str, prompts, out_lens) -> tuple[float, list[float], int]:
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, p, n) for p, n in zip(prompts, out_lens)))
        return time.perf_counter() - start, [r[0] for r in results], sum(r[1] for r in results)


def _clients(url: str, prompts, out_lens) -> tuple[float, list[float], int, float]:
    cpu = time.process_time()
    return *asyncio.run(_burst(url, prompts, out_lens)), time.process_time() - cpu


def _client_burst(pool, url: str, prompts, out_lens) -> tuple[float, list[float], int, float]:
    """The requests spread over the pool's processes: (seconds, times to first token, tokens, clients' CPU s)."""
    n = pool._processes
    start = time.perf_counter()
    parts = pool.starmap(_clients, [(url, prompts[i::n], out_lens[i::n]) for i in range(n)])
    return (time.perf_counter() - start, [t for part in parts for t in part[1]], sum(part[2] for part in parts),
            sum(part[3] for part in parts))


def _serve(engine: EngineClient) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "bench"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def _offline(model: str, settings: dict, prompts, out_lens) -> tuple[float, int]:
    """LLM.generate's output tok/s on the workload and the steps it took (in a process of its own, which frees its
    GPU when done)."""
    llm = LLM(model, **settings)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params[:4], use_tqdm=False)  # warm-up
    engine, steps = llm.llm_engine, [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(out_lens) / (time.perf_counter() - start), steps[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--client-processes", type=int, default=4)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = resolve_model(args.model, dtype, load_format=args.load_format)
    # no prefix cache: the warm-up's and the first run's prompts would serve the later runs' from it
    settings = dict(device=args.device, load_format=args.load_format, enable_prefix_caching=False)
    prompts, out_lens = make_workload(args, AutoConfig.from_pretrained(model).vocab_size)
    spawn = multiprocessing.get_context("spawn")
    with spawn.Pool(1) as offline_run:
        offline, offline_steps = offline_run.apply(_offline, (model, settings, prompts, out_lens))
    engine = EngineClient(model, settings)
    server, url = _serve(engine)
    with spawn.Pool(args.client_processes) as clients:
        _client_burst(clients, url, prompts[:8], [8] * 8)  # the processes up, their imports done; the engine warm
        before, server_cpu = engine.stats(), time.process_time()
        seconds, _, tokens, clients_cpu = _client_burst(clients, url, prompts, out_lens)
        after, server_cpu = engine.stats(), time.process_time() - server_cpu
        ttft = {n: sorted(_client_burst(clients, url, prompts[:n], [16] * n)[1])[n // 2] for n in (1, 16, 64)
                if n <= len(prompts)}
    server.should_exit = True
    engine.close()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print("| device | date | model | config |\n|---|---|---|---|")
    print(f"| {device} | {datetime.date.today()} | {args.model} | {args.num_seqs} streamed requests, in "
          f"U{args.input_len}, out U{args.output_len}, temperature 0.6 |")
    print("| path | output tok/s | vs offline |\n|---|---|---|")
    print(f"| LLM.generate | {offline:.0f} | 1.00x |")
    print(f"| nanovllm serve, {len(prompts)} concurrent streams | {tokens / seconds:.0f} | "
          f"{tokens / seconds / offline:.2f}x |")
    print("| concurrent requests | median time to first token, ms |\n|---|---|")
    for n, ttft_s in ttft.items():
        print(f"| {n} | {ttft_s * 1e3:.1f} |")
    steps, step_s = after["steps"] - before["steps"], after["step_seconds"] - before["step_seconds"]
    print(f"\nserved run: {seconds:.2f} s; the engine stepped {steps} times ({offline_steps} offline) for {step_s:.2f} s; "
          f"CPU seconds: engine {after['cpu_seconds'] - before['cpu_seconds']:.2f}, server {server_cpu:.2f}, "
          f"{args.client_processes} client processes {clients_cpu:.2f}")


if __name__ == "__main__":
    main()
