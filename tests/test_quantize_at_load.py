"""quantization="fp8" / "int8" / "int4" on a 16-bit checkpoint: the quantizers (quant/quantize.py) against their
error bounds, each layer path against F.linear on the dequantized weight (the Triton GEMV with a per-channel scale
on CPU under TRITON_INTERPRET=1 and on the GPU; _scaled_mm and the INT4 kernels on the GPU), and whole models
against the dense model holding the dequantized weights: identical greedy tokens on CPU in fp32."""
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_as_exact_as_dense, kernel_tol, prompt_logprob_gap
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.layers.linear import QKVLinear
from nanovllm.quant.quantize import dequantize_per_channel, quantize_int4, quantize_per_channel
from nanovllm.quant.registry import get_quantization_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    w[1] = 0  # a zero row: scale 1, no division by zero
    return w


def dequantized(w: torch.Tensor, name: str) -> torch.Tensor:
    """float32: what the model computes with once w is quantized by `name`."""
    if name == "int4":
        return quantize_int4(w).dequantize()
    return dequantize_per_channel(*quantize_per_channel(w, {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[name]))


def test_per_channel_quantizers_stay_within_half_a_step():
    w = weight(64, 256)
    q, scale = quantize_per_channel(w, torch.int8)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale[1] == 1
    assert ((dequantize_per_channel(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    q, scale = quantize_per_channel(w, torch.float8_e4m3fn)
    amax = w.abs().amax(1, keepdim=True)
    assert q.dtype == torch.float8_e4m3fn and (q.float().abs().amax(1) == torch.where(amax[:, 0] > 0, 448.0, 0.0)).all()
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, or of its subnormal step 2^-9 x scale
    err = (dequantize_per_channel(q, scale) - w).abs()
    assert (err <= torch.maximum(w.abs() / 16, scale[:, None] * 2.0 ** -10) * 1.0001 + 1e-9).all()


def test_int4_quantizer_stays_within_half_a_step_and_is_its_twin():
    w = weight(8, 512)
    q = quantize_int4(w)
    assert q.type_name == "INT4_G128" and q.nbytes == 8 * 512 // 128 * 68
    d, m = q.fields["d"].float(), q.fields["m"].float()
    nibbles = torch.stack([q.fields["qs"] & 15, q.fields["qs"] >> 4], dim=-1)  # byte i: weights i and 64 + i
    quants = nibbles.reshape(8, 4, 64, 2).transpose(2, 3).reshape(8, 4, 128).float()
    direct = (d[..., None] * quants + m[..., None]).reshape(8, 512)
    assert torch.equal(q.dequantize(), direct)  # the twin (gguf_formats) reads the layout the quantizer wrote
    groups = w.reshape(8, 4, 128)
    slack = (groups.amin(-1) - m).abs()[..., None]  # m is the group's minimum rounded to fp16
    assert ((direct.reshape(8, 4, 128) - groups).abs() <= d[..., None] / 2 + slack + 1e-6).all()
    with pytest.raises(ValueError, match="groups of 128 weights; a row of 200"):
        quantize_int4(torch.zeros(4, 200))


@pytest.mark.gpu  # TRITON_INTERPRET=1 rounds to e4m3 its own way (values several steps apart)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 300), (70, 4096)])
def test_per_token_fp8_kernel_is_its_twin(rows, n):
    from nanovllm.kernels.fp8_quant import per_token_fp8
    from nanovllm.quant.per_channel import per_token_fp8_reference

    x = (torch.randn(rows, n, generator=torch.Generator().manual_seed(7)) * 3).to(DEVICE, torch.bfloat16)
    x[0] = 0  # a zero row: the smallest scale, zero quants
    (q, scale), (q_ref, scale_ref) = per_token_fp8(x), per_token_fp8_reference(x)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # a quotient a rounding apart may land on the neighbouring e4m3 value
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.13, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


def qkv_layer(name: str, dtype: torch.dtype, k: int = 256, bias: bool = False):
    """A QKV layer under `name`'s method, loaded shard by shard, and the dense float32 weight it holds."""
    config = get_quantization_config(name, torch.device(DEVICE), dtype, use_kernels=DEVICE == "cuda")
    with torch.device(DEVICE):
        layer = QKVLinear(k, head_dim=32, num_heads=4, num_kv_heads=2, bias=bias, linear_method=config.linear_method())
    shards = {"q": weight(128, k, 1), "k": weight(64, k, 2), "v": weight(64, k, 3)}
    for sid, w in shards.items():
        layer.weight_loader(layer.weight, w.to(dtype), sid)
    if bias:
        layer.weight_loader(layer.bias, torch.randn(256).to(dtype), "q")
    config.finish_loading(torch.nn.ModuleDict({"qkv_proj": layer}))
    dense = torch.cat([dequantized(w.to(dtype).float(), name) for w in shards.values()])
    if name == "int4":  # CPU: a piece a shard in torch's int4 layout (quant/cpu_int4.py); CUDA: one stacked
        pieces = layer.cpu_pieces if DEVICE == "cpu" else layer.qweights
        held = torch.cat([w.dequantize() for _, w in pieces]).cpu()
    else:
        held = dequantize_per_channel(layer.qweight, layer.weight_scale).cpu()
    # quantized on the device, where a value may round to the neighbouring quant: at most one step apart
    step = {"int8": 2 * 0.25 / 127, "fp8": 0.25 / 448 * 2 ** -2, "int4": 2 * 0.5 / 15}[name]
    torch.testing.assert_close(held, dense, atol=step, rtol=0.13)
    return layer, held


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 16, 65, 300])
def test_layer_matches_the_dequantized_weight(name, rows):
    dtype = torch.float32 if DEVICE == "cpu" else (torch.float16 if name == "int4" else torch.bfloat16)
    layer, dense = qkv_layer(name, dtype)
    assert layer.weight is None
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 256)
    if name == "fp8" and DEVICE == "cuda" and rows > 64:  # e4m3 activations: ~2^-4 of each product
        torch.testing.assert_close(got.float(), F.linear(x.float(), dense.to(DEVICE)), atol=0.1, rtol=0.1)
    elif rows == 1 and DEVICE == "cuda":
        assert_as_exact_as_dense(got, x, dense.to(DEVICE))
    else:  # int4 on CPU: bf16 activations
        torch.testing.assert_close(got.float(), F.linear(x.float(), dense.to(DEVICE).to(dtype).float()),
                                   **kernel_tol(torch.bfloat16 if name == "int4" and DEVICE == "cpu" else dtype))
    out = torch.full((rows, 256), float("nan"), dtype=dtype, device=DEVICE)  # a CUDA graph's static output
    assert layer.linear_method.apply(layer, x, out=out) is out and torch.equal(out, got)


def dequantized_checkpoint(src: str, dst, name: str) -> str:
    """A copy of the model directory whose projections hold `name`'s dequantized weights (float32)."""
    shutil.copytree(src, dst)
    files = [p for p in dst.iterdir() if p.suffix == ".safetensors"]
    for path in files:
        tensors = load_file(path)
        for key, t in tensors.items():
            if any(f".{p}." in key for p in PROJECTIONS):
                tensors[key] = dequantized(t, name).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def greedy(llm) -> list[list[int]]:
    """Three prompts of 78 tokens together: one prefill step past the GEMV's 64 rows, eager or padded in a graph,
    so that both take the same path."""
    prompts = [{"prompt_token_ids": ids} for ids in ([1, 5, 9, 200, 7], [3, 3, 40], list(range(10, 80)))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_cpu_model_generates_as_its_dequantized_checkpoint(tiny_model_dir, tmp_path, name):
    """fp8 and int8 multiply fp32 activations on CPU: the dequantized checkpoint's greedy tokens. int4 multiplies bf16
    ones (quant/cpu_int4.py), which a random tiny model's near ties turn into other tokens: its prompt logprobs
    instead, within bf16's error."""
    src = tiny_model_dir("tiny-llama-128")
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    quantized = LLM(src, quantization=name, **kw)
    runner = quantized.llm_engine.model_runner
    proj = runner.model.model.layers[0].self_attn.qkv_proj
    assert proj.weight is None  # no dense copy is kept
    dense = LLM(dequantized_checkpoint(src, tmp_path / name, name), **kw)
    if name != "int4":
        assert greedy(quantized) == greedy(dense)
        return
    gap = prompt_logprob_gap(quantized, dense, list(range(10, 80)))
    assert gap < 5e-2, gap


def test_quantize_at_load_bad_input(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization='int4' quantizes rows in groups of 128.*rows of 64 weights"):
        LLM(tiny_model_dir("tiny-llama"), device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="got 'fp4'"):
        LLM(tiny_model_dir("tiny-llama"), device="cpu", quantization="fp4")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_cuda_model_quantized_at_load(tiny_model_dir, name):
    """CUDA graphs replay what eager steps compute; greedy agreement with the dense model is reported."""
    src = tiny_model_dir("tiny-llama-128")
    dtype = torch.float16 if name == "int4" else torch.bfloat16
    kw = dict(dtype=dtype, max_model_len=256, kv_cache_memory_bytes=64 << 20, gpu_memory_utilization=0.5)
    graphs = greedy(LLM(src, quantization=name, **kw))
    assert graphs == greedy(LLM(src, quantization=name, enforce_eager=True, **kw))
    dense = greedy(LLM(src, **kw))
    same = sum(next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), len(s)) for s, t in zip(graphs, dense))
    print(f"{name}: greedy agreement with the dense model {same / sum(map(len, dense)):.1%}")

