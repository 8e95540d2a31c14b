"""`nanovllm serve` against LLM.generate on the same engine: nano-vLLM's workload sent as concurrent streaming
completions (token-id prompts, ignore_eos, temperature 0.6) through the OpenAI route, its output tok/s against the
offline run's in the same process; and the time to first token at 1, 16 and 64 concurrent requests. The clients run
in a process of their own, as users' would: they do not share the server's interpreter.

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

from nanovllm import LLM, SamplingParams
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


def _clients(url: str, prompts, out_lens) -> tuple[float, list[float], int]:
    return asyncio.run(_burst(url, prompts, out_lens))


def _serve(llm) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm, "bench"), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    llm = LLM(resolve_model(args.model, dtype, load_format=args.load_format), device=args.device,
              load_format=args.load_format)
    prompts, out_lens = make_workload(args, llm.llm_engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    offline = sum(out_lens) / (time.perf_counter() - start)
    llm.reset_prefix_cache()
    server, url = _serve(llm)
    clients = multiprocessing.get_context("spawn").Pool(1)
    clients.apply(_clients, (url, prompts[:1], [1]))  # the process is up, its imports done
    seconds, _, tokens = clients.apply(_clients, (url, prompts, out_lens))
    llm.reset_prefix_cache()
    ttft = {n: sorted(clients.apply(_clients, (url, prompts[:n], [16] * n))[1])[n // 2] for n in (1, 16, 64)
            if n <= len(prompts)}
    clients.close()
    server.should_exit = True
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print("| device | date | model | config |\n|---|---|---|---|")
    print(f"| {device} | {datetime.date.today()} | {args.model} | {args.num_seqs} streamed requests, in "
          f"U{args.input_len}, out U{args.output_len}, temperature 0.6 |")
    print("| path | output tok/s | vs offline |\n|---|---|---|")
    print(f"| LLM.generate | {offline:.0f} | 1.00x |")
    print(f"| nanovllm serve, {len(prompts)} concurrent streams | {tokens / seconds:.0f} | "
          f"{tokens / seconds / offline:.2f}x |")
    print("| concurrent requests | median time to first token, ms |\n|---|---|")
    for n, seconds in ttft.items():
        print(f"| {n} | {seconds * 1e3:.1f} |")


if __name__ == "__main__":
    main()
