"""Compile every shipped Triton kernel launch for the H100 (sm_90) on a machine without a GPU.

The CPU tests run the kernels under TRITON_INTERPRET=1, which executes them with numpy and never compiles them,
so an error that only the compiler sees (a loop that changes a variable's tile shape, a bad layout) would first
show on the device. Here each kernel wrapper runs on CPU tensors at real model shapes with its launch
intercepted; the intercepted arguments become a signature with the specializations Triton's launcher would make
(16-byte aligned pointers, integers divisible by 16), PDL on, and that is compiled to PTX and run through
ptxas; each variant's registers, spills and shared memory are printed. Must run without TRITON_INTERPRET.
usage: python scripts/compile_check.py"""
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

assert os.environ.get("TRITON_INTERPRET") != "1", "compile_check compiles kernels: run it without TRITON_INTERPRET=1"
from nanovllm.attention.metadata import prefill_tile_tokens, prefill_tiles  # noqa: E402
from nanovllm.kernels.activation import silu_and_mul  # noqa: E402
from nanovllm.kernels.decode_inputs import advance_decode_inputs, prepare_decode_inputs  # noqa: E402
from nanovllm.kernels.embedding import embedding  # noqa: E402
from nanovllm.kernels.gemv import gemv  # noqa: E402
from nanovllm.kernels.gguf_gemv import KERNEL_TYPES, gguf_gemv  # noqa: E402
from nanovllm.kernels.kv_store import store_kv  # noqa: E402
from nanovllm.kernels.paged_attention import paged_decode, paged_prefill  # noqa: E402
from nanovllm.kernels.rms_norm import rms_norm  # noqa: E402
from nanovllm.kernels.rotary import rotary_  # noqa: E402
from nanovllm.kernels.sampling import gumbel_argmax  # noqa: E402
from nanovllm.quant.gguf_formats import BLOCK_FORMATS  # noqa: E402
from nanovllm.quant.gguf_weight import GGUFWeight  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024  # the H100's shared memory a block may ask for
OPTIONS = ("num_warps", "num_stages")
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64",
                 torch.int32: "*i32", torch.uint8: "*u8"}
launches = []  # (kernel, args, kwargs) of every launch the wrappers made


def _record(self, *args, grid, warmup, **kwargs):
    launches.append((self, args, kwargs))


def _signature(kernel: JITFunction, args, kwargs):
    """Triton's launcher types and specializes the runtime arguments; the rest are constexprs."""
    names = [p.name for p in kernel.params if not p.is_constexpr]
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            signature[name], aligned = "fp32", False
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        if aligned:
            attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
    constexprs = {k: v for k, v in kwargs.items() if k not in OPTIONS and k != "launch_pdl"}
    constexprs["PDL"] = True
    signature.update({k: "constexpr" for k in constexprs})
    return signature, constexprs, attrs


def compile_launch(kernel, args, kwargs):
    """The compiled kernel (PTX and cubin in .asm)."""
    signature, constexprs, attrs = _signature(kernel, args, kwargs)
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=options)


def resource_usage(compiled) -> str:
    """Registers and local memory (spills) per thread, as cuobjdump reads them from the cubin, and the shared
    memory the launch asks for."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|LOCAL):(\d+)", usage))
    return (f"{found.get('REG', '?')} registers, {found.get('LOCAL', '?')} B local (spills), "
            f"{compiled.metadata.shared} B shared")


def launch_everything():
    """Every wrapper at Qwen3-0.6B shapes (and the odd sizes the tests use), as the engine calls them."""
    g = torch.Generator().manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(8, 1024, dtype=dtype, generator=g)
        rms_norm(x, torch.ones(1024, dtype=dtype), 1e-6)
        rms_norm(x, torch.ones(1024, dtype=dtype), 1e-6, torch.randn(8, 1024, dtype=dtype))
        silu_and_mul(torch.randn(8, 6144, dtype=dtype))
        qkv = torch.randn(8, 4096, dtype=dtype)
        q, k = qkv[:, :2048].view(8, 16, 128), qkv[:, 2048:3072].view(8, 8, 128)
        table = torch.randn(4096, 128, dtype=dtype)
        rotary_(torch.arange(8), q, k, table, table)
        rotary_(torch.arange(8), q, k, table, table, torch.ones(128, dtype=dtype), torch.ones(128, dtype=dtype), 1e-6)
        layers = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (28672, 4096))
        for rows in (1, 16):  # fp32 GEMVs run only in the kernel tests, at their shapes
            for n, k_dim in layers if dtype == torch.bfloat16 else ((4096, 1024), (1024, 3072)):
                gemv(torch.randn(rows, k_dim, dtype=dtype), torch.empty(n, k_dim, dtype=dtype))
        gemv(torch.randn(3, 300, dtype=dtype), torch.randn(33, 300, dtype=dtype), torch.randn(33, dtype=dtype))
        for rows in (24, 64) if dtype == torch.bfloat16 else ():  # 17-64 rows (NANOVLLM_GEMV_ROWS above 16)
            for n, k_dim in layers:
                gemv(torch.randn(rows, k_dim, dtype=dtype), torch.empty(n, k_dim, dtype=dtype))
        for rows, splits in ((256, 1), (4, None), (1, 64)):  # this CPU counts as 4 SMs: pick the H100's splits
            logits, seeds = torch.empty(rows, 151936, dtype=dtype), torch.zeros(rows, dtype=torch.int64)
            gumbel_argmax(logits, seeds, seeds, num_splits=splits)
            gumbel_argmax(logits, seeds, seeds, torch.ones(rows), num_splits=splits)
    k_cache, v_cache = (torch.randn(64, 16, 8, 128, **bf16) for _ in range(2))
    kv = torch.randn(8, 4096, **bf16)
    store_kv(kv[:, 2048:3072].view(8, 8, 128), kv[:, 3072:].view(8, 8, 128), k_cache, v_cache, torch.arange(8))
    tables = torch.zeros(8, 16, dtype=torch.int32)
    lens = torch.full((8,), 100, dtype=torch.int32)
    positions, num_rows = torch.zeros(8, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    prepare_decode_inputs(positions, lens, positions.clone(), tables, num_rows, 64, 16)
    advance_decode_inputs(positions, positions.clone(), positions.clone(), positions.clone(), num_rows)
    ring_state = torch.zeros(2, dtype=torch.int32)  # with the token ring of the decode graphs
    prepare_decode_inputs(positions, lens, positions.clone(), tables, num_rows, 64, 16, ring_state, 4)
    table = torch.randn(151936, 1024, **bf16)  # the decode graphs' first kernel gathers the input embeddings too
    prepare_decode_inputs(positions, lens, positions.clone(), tables, num_rows, 64, 16, ring_state, 4, positions,
                          table)
    embedding(positions, table)
    advance_decode_inputs(positions, positions.clone(), positions.clone(), positions.clone(), num_rows,
                          torch.zeros(4, 8, dtype=torch.int64), ring_state)
    q = torch.randn(8, 16, 128, **bf16)
    for splits in (1, 4, 16):
        paged_decode(q, k_cache, v_cache, tables, lens, 0.088, splits)
        new_kv = (kv[:, 2048:3072].view(8, 8, 128), kv[:, 3072:].view(8, 8, 128), torch.arange(8))
        paged_decode(q, k_cache, v_cache, tables, lens, 0.088, splits, new_kv=new_kv)
        paged_decode(q, k_cache, v_cache, tables, lens, 0.088, splits, lse=torch.empty(8, 16))  # offloaded KV
    starts = torch.arange(0, 9 * 8, 8, dtype=torch.int32)
    tile_tokens = prefill_tile_tokens(2)  # Qwen3-0.6B's group of 2 query heads a KV head
    tiles = torch.from_numpy(prefill_tiles([8] * 8, tile_tokens))
    paged_prefill(torch.randn(64, 16, 128, **bf16), k_cache, v_cache, tables, lens, starts, tiles, 0.088)
    paged_prefill(torch.randn(64, 16, 128, **bf16), k_cache, v_cache, tables, lens, starts, tiles, 0.088,
                  lse=torch.empty(64, 16))  # offloaded KV
    for type_name in KERNEL_TYPES:  # the quantized GEMV / GEMM at Llama-3-8B's widest shape
        fmt = BLOCK_FORMATS[type_name]
        weight = GGUFWeight.from_blocks(torch.zeros(1024, fmt.row_bytes(4096), dtype=torch.uint8), type_name, (1024, 4096))
        for rows in (1, 16, 32, 64, 256):  # each tile config of gguf_gemv.launch_config
            gguf_gemv(torch.randn(rows, 4096, **bf16), weight)


def main() -> int:
    run = JITFunction.run
    JITFunction.run = _record
    try:
        launch_everything()
    finally:
        JITFunction.run = run
    seen, failed = set(), 0
    for kernel, args, kwargs in launches:
        signature, constexprs, _ = _signature(kernel, args, kwargs)
        key = (kernel.__name__, tuple(sorted(signature.items())), tuple(sorted(map(str, constexprs.items()))),
               tuple(kwargs.get(k) for k in OPTIONS))
        if key in seen:
            continue
        seen.add(key)
        config = ", ".join(f"{k}={v}" for k, v in constexprs.items() if k != "PDL")
        try:
            compiled = compile_launch(kernel, args, kwargs)
            if compiled.metadata.shared > MAX_SHARED:
                raise RuntimeError(f"asks for {compiled.metadata.shared} B of shared memory, over the {MAX_SHARED} B a block has")
            print(f"ok   {kernel.__name__}({config}): {resource_usage(compiled)}")
        except Exception as e:  # report every failure, not just the first
            failed += 1
            print(f"FAIL {kernel.__name__}({config}): {type(e).__name__}: {str(e)[:2000]}")
    print(f"{len(seen)} kernel variants compiled for sm_90, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
