"""Random-weight models at real shapes, written as HF model directories (config.json, safetensors, a
tokenizer), so tests and benchmarks run where no model hub is reachable. Speed does not depend on values.

    python -m nanovllm.weights.synthetic qwen3-0.6b /tmp/qwen3-0.6b
    python -m nanovllm.weights.synthetic llama3-70b /tmp/llama3-70b --config-only  # for load_format="dummy"
"""
import argparse
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from nanovllm.models.qwen3_next import layer_types
from nanovllm.weights.random_blocks import random_block_weight

HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # linear and gated full attention, 1 + w norms
_BASE = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
_QWEN3_NEXT = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                   intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                   num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=262144,
                   rope_theta=10000000.0, partial_rotary_factor=0.25, attention_bias=False)
_QWEN3_5 = dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", vocab_size=248320,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                max_position_embeddings=262144, attention_bias=False,
                rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))
SHAPES = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama3-70b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0),
    "qwen3-next-80b-a3b": _QWEN3_NEXT,
    # Qwen3.5's text models as their configs give them (layers, widths, experts, the linear attention's heads)
    "qwen3.5-35b-a3b": dict(_QWEN3_5, hidden_size=2048, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            num_hidden_layers=40, num_attention_heads=16, linear_num_value_heads=32, num_experts=256,
                            num_experts_per_tok=8),
    "qwen3.5-397b-a17b": dict(_QWEN3_5, hidden_size=4096, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024, num_hidden_layers=60, num_attention_heads=32,
                              linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10),
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True,
                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=128)),
    "tiny-llama-128": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
                           intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True),  # int4 groups
    "tiny-qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, rope_theta=10000.0),
    "tiny-qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                           decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=1024,
                           rope_theta=10000.0),
    "tiny-qwen3-next": dict(_QWEN3_NEXT, vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=8, full_attention_interval=2, num_experts=5, num_experts_per_tok=2,
                            mlp_only_layers=[1], max_position_embeddings=1024, rope_theta=10000.0),
    "tiny-qwen3.5-moe": dict(_QWEN3_5, vocab_size=512, hidden_size=64, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=8, full_attention_interval=2, num_experts=6, num_experts_per_tok=2,
                             max_position_embeddings=1024,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=1024, rope_theta=10000.0),
}


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight of a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen3-Next config (a dict)."""
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    hybrid = c["model_type"] in HYBRID_TYPES
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if hybrid and layer_types(SimpleNamespace(**c))[i] == "linear_attention":
            shapes.update(_gated_deltanet_shapes(c, p + "linear_attn."))
            shapes.update(_mlp_shapes(c, i, p))
            continue
        gated = 2 if hybrid else 1  # q_proj gives each head's query and output gate
        shapes.update({p + "self_attn.q_proj.weight": (gated * q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        shapes.update(_mlp_shapes(c, i, p))
        if c["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if c["model_type"] in ("qwen3", "qwen3_moe") or hybrid:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def _gated_deltanet_shapes(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's projections interleaved by key head (in_proj_qkvz, in_proj_ba), Qwen3.5's one each."""
    h, hk, hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    key, value = hk * c["linear_key_head_dim"], hv * c["linear_value_head_dim"]
    if c["model_type"] == "qwen3_next":
        shapes = {p + "in_proj_qkvz.weight": (2 * key + 2 * value, h), p + "in_proj_ba.weight": (2 * hv, h)}
    else:
        shapes = {p + "in_proj_qkv.weight": (2 * key + value, h), p + "in_proj_z.weight": (value, h),
                  p + "in_proj_b.weight": (hv, h), p + "in_proj_a.weight": (hv, h)}
    return {**shapes, p + "conv1d.weight": (2 * key + value, 1, c["linear_conv_kernel_dim"]), p + "dt_bias": (hv,),
            p + "A_log": (hv,), p + "norm.weight": (c["linear_value_head_dim"],), p + "out_proj.weight": (h, value)}


def _mlp_shapes(c: dict, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Layer i's MLP: dense, or (Qwen3-MoE's sparse layers) a router and each expert's three projections."""
    h = c["hidden_size"]
    sparse = c.get("num_experts", 0) > 0 and i not in c.get("mlp_only_layers", []) \
        and (i + 1) % c.get("decoder_sparse_step", 1) == 0
    if not sparse:
        ff = c["intermediate_size"]
        return {p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h), p + "mlp.down_proj.weight": (h, ff)}
    ff = c["moe_intermediate_size"]
    shapes = {p + "mlp.gate.weight": (c["num_experts"], h)}
    if shared := c.get("shared_expert_intermediate_size"):
        shapes.update({p + "mlp.shared_expert.gate_proj.weight": (shared, h), p + "mlp.shared_expert.up_proj.weight":
                       (shared, h), p + "mlp.shared_expert.down_proj.weight": (h, shared),
                       p + "mlp.shared_expert_gate.weight": (1, h)})
    for e in range(c["num_experts"]):
        shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (ff, h), f"{p}mlp.experts.{e}.up_proj.weight": (ff, h),
                       f"{p}mlp.experts.{e}.down_proj.weight": (h, ff)})
    return shapes


def _random(name: str, shape, generator, device, zero_centered_norms: bool = False) -> torch.Tensor:
    """Scaled so activations and logits stay O(1): greedy choices are then far from ties. zero_centered_norms:
    RMSNorms that scale by 1 + weight (Qwen3-Next's, but for the gated one inside its linear attention)."""
    if name.endswith("norm.weight"):
        centre = 0 if zero_centered_norms and ".linear_attn." not in name else 1
        return centre + 0.1 * torch.randn(shape, generator=generator, device=device)
    if name.endswith("A_log"):  # the decay rates' logs, as HF draws them
        return torch.empty(shape, device=device).uniform_(1, 16, generator=generator).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape, device=device)
    std = 0.02 if name.endswith("bias") else (2 if "embed_tokens" in name else 1) / math.sqrt(shape[-1])
    return std * torch.randn(shape, generator=generator, device=device)


def write_tokenizer(out: Path, vocab_size: int):
    """A word-level tokenizer: ids 0-2 are <unk> <s> </s>, id i >= 3 is the word t{i}. It covers any
    vocab size instantly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(out)


def random_weights(config: dict, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                   experts_type: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight of a Llama / Qwen2 / Qwen3 config, drawn on `device` in a fixed order: the
    same seed and device give the same values (load_format="dummy" draws what write_model writes). experts_type (a
    GGUF block type): each layer's experts instead as three stacked GGUFWeights of random blocks (gate_proj, up_proj
    [experts x I, H], down_proj [experts x H, I]), as a GGUF file gives them."""
    generator = torch.Generator(device).manual_seed(seed)
    stacked = set()
    for name, shape in weight_shapes(config).items():
        if experts_type is not None and (match := _EXPERT.fullmatch(name)):
            if (match["layer"], match["proj"]) not in stacked:
                stacked.add((match["layer"], match["proj"]))
                yield _random_experts(config, match, shape, experts_type, generator)
            continue
        yield name, _random(name, shape, generator, device, config["model_type"] in HYBRID_TYPES).to(dtype)


_EXPERT = re.compile(r"(?P<prefix>model\.layers\.(?P<layer>\d+)\.mlp\.experts\.)\d+\.(?P<proj>\w+)\.weight")


def _random_experts(config: dict, match, shape: tuple[int, int], type_name: str, generator):
    """A layer's every expert's projection, stacked, in random blocks of type_name: mean 0, std 1 / sqrt(inputs)."""
    rows, cols = shape
    weight = random_block_weight(type_name, config["num_experts"] * rows, cols, 1 / math.sqrt(cols), generator)
    return match["prefix"] + match["proj"], weight


def write_config(shape: str | dict, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """config.json and a tokenizer, no weights: enough for load_format="dummy"."""
    config = {**_BASE, **(SHAPES[shape] if isinstance(shape, str) else shape)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json.dump({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, open(out / "config.json", "w"), indent=1)
    write_tokenizer(out, config["vocab_size"])
    return out, config


def write_model(shape: str | dict, out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                device: str | None = None, shard_bytes: int = 4 << 30) -> Path:
    out, config = write_config(shape, out_dir, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shard, shard_size, index, n, total = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, shard_size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_size, n = {}, 0, n + 1

    for name, tensor in random_weights(config, dtype, device, seed):
        shard[name] = tensor.cpu()
        shard_size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if shard_size > shard_bytes:
            flush()
    flush()
    json.dump({"metadata": {"total_size": total}, "weight_map": index}, open(out / "model.safetensors.index.json", "w"))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="config.json and the tokenizer, no weights: for "
                    "LLM(..., load_format='dummy'), which draws the weights at load")
    args = ap.parse_args()
    if args.config_only:
        print(write_config(args.shape, args.out_dir, getattr(torch, args.dtype))[0])
    else:
        print(write_model(args.shape, args.out_dir, getattr(torch, args.dtype), args.seed))
