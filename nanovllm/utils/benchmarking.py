"""What the benchmarks (bench*.py, scripts/) share: the model names they take, nano-vLLM's workload, the HBM
bandwidth measured in the same run, and the timing of microsecond kernels as a decode step sees them: replayed from
a CUDA graph (no launch overhead), each call on its own copy of the data so that nothing is served from L2 that a
real step would read from HBM."""
import os
import random
import tempfile
import time

import torch

from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.weights.bundled import bundled_model_path
from nanovllm.weights.synthetic import SHAPES, write_config, write_model

L2_FLUSH_BYTES = 256 << 20  # several times the H100's 50 MB L2


def resolve_model(name: str, dtype: torch.dtype, tokenizer_gguf: str | None = None, load_format: str = "auto") -> str:
    """'smollm2', a synthetic shape ('llama3-8b'; with load_format "dummy" its config alone, the weights drawn at
    load), a synthetic GGUF ('llama3-8b:Q4_K', its tokenizer from tokenizer_gguf or the bundled model; with "dummy"
    a mixture's config alone, its experts drawn as Q4_K blocks at load with quantization="gguf"), or a path."""
    if name == "smollm2":
        return bundled_model_path()
    if name in SHAPES:
        out_dir = tempfile.mkdtemp(prefix=f"nanovllm-{name}-")
        return str(write_config(name, out_dir, dtype)[0] if load_format == "dummy" else write_model(name, out_dir, dtype))
    shape, _, type_name = name.partition(":")
    if shape in SHAPES and type_name and load_format == "dummy":
        if type_name != "Q4_K" or not SHAPES[shape].get("num_experts"):
            raise ValueError(f"{name} with load_format dummy: only a mixture's experts are drawn in blocks, as Q4_K")
        return str(write_config(shape, tempfile.mkdtemp(prefix=f"nanovllm-{shape}-"), dtype)[0])
    if shape in SHAPES and type_name:
        from nanovllm.weights.synthetic_gguf import write_gguf

        return str(write_gguf(shape, type_name, os.path.join(tempfile.mkdtemp(), f"{shape}-{type_name}.gguf"),
                              tokenizer_gguf))
    return name


def make_workload(args, vocab: int):
    """nano-vLLM's workload: args.num_seqs prompts of random tokens, prompt and output lengths uniform in
    args.input_len and args.output_len, drawn from args.seed."""
    rng = random.Random(args.seed)
    prompts = [[rng.randint(100, vocab - 1) for _ in range(rng.randint(*args.input_len))] for _ in range(args.num_seqs)]
    out_lens = [rng.randint(*args.output_len) for _ in range(args.num_seqs)]
    return prompts, out_lens


def measure_hbm_bandwidth() -> float:
    """Bytes read plus written per second of a large device-to-device copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 20 / (time.perf_counter() - start)


def copies_needed(nbytes: int) -> int:
    """Copies of nbytes of data that, called in turn, leave none of them in L2."""
    return max(2, -(-L2_FLUSH_BYTES // max(nbytes, 1)))


def graph_time(calls, replays: int = 20) -> float:
    """Seconds per call of calls (zero-argument functions, each on different data), captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the capture: compiles, cuBLAS workspaces
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * len(calls))


def weight_bytes_per_step(model: torch.nn.Module, batch: int | None = None) -> int:
    """Bytes of weights that one step reads: each parameter, buffer and quantized weight once (a tied LM head and
    embedding once), except an input embedding that the LM head does not share: a step reads only its tokens' rows
    of that. With `batch`, a mixture of experts counts the experts that many tokens route to on average under uniform
    routing, E (1 - (1 - k / E)^batch) of a layer's E (the active weights: k of E at batch 1)."""
    embed = model.model.embed_tokens
    head = {id(t) for t in [model.lm_head.weight, *(w for _, w in getattr(model.lm_head, "qweights", []))]}
    # parameters and persistent buffers (an int8 / fp8 weight and its scales), not the rotary tables
    weights = {id(t): t.numel() * t.element_size() for t in model.state_dict(keep_vars=True).values() if not t.is_meta}
    for module in model.modules():
        weights.update((id(w), w.nbytes) for _, w in getattr(module, "qweights", []))
    for table in (embed.weight, embed.qweight):
        if table is not None and id(table) not in head:
            weights.pop(id(table), None)
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.quantized is not None:  # experts kept in their blocks
            weights[id(module.quantized)] = module.quantized.nbytes
        if isinstance(module, FusedMoE) and batch is not None:
            routed = 1 - (1 - module.top_k / module.num_experts) ** batch
            for held in (module.w13, module.w2, module.quantized):
                if held is not None:
                    weights[id(held)] = int(weights[id(held)] * routed)
    return sum(weights.values())


def kv_bytes_per_token(runner) -> int:
    """K and V of one token across every layer."""
    return runner.plan.kv.block_bytes // runner.plan.kv.block_size


def count_bytes_read(runner) -> list[int]:
    """A one-item counter of the bytes that every step launched from now on reads (the HBM roofline's bytes): the
    weights once, and the KV of each sequence's whole context."""
    weights, per_token, launch, total = weight_bytes_per_step(runner.model), kv_bytes_per_token(runner), runner.launch, [0]

    def counted_launch(seqs, *args, **kwargs):
        total[0] += weights + per_token * sum(s.num_computed_tokens + s.num_scheduled_tokens for s in seqs)
        return launch(seqs, *args, **kwargs)

    runner.launch = counted_launch
    return total
