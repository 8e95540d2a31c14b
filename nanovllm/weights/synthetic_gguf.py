"""Random-weight GGUF files at real shapes in any block type of quant.gguf_formats, so that quantized kernels and
engines (ours, llama.cpp) can be benchmarked on the same file where no model hub is reachable. The blocks are random
bytes whose f16 scales are set so that each weight matrix has mean 0 and the std of synthetic.py's dense weights;
the tokenizer (and so the vocabulary) comes from a donor GGUF, by default the bundled SmolLM2.

    python -m nanovllm.weights.synthetic_gguf llama3-8b Q4_K /tmp/llama3-8b-q4_k.gguf [--tokenizer tok.gguf]
"""
import argparse
import math
from pathlib import Path

import numpy as np

from nanovllm.quant.gguf_formats import FORMATS
from nanovllm.weights.gguf_loader import copy_tokenizer_metadata
from nanovllm.weights.random_blocks import random_blocks
from nanovllm.weights.synthetic import SHAPES


def _tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """GGUF names -> (rows, cols) of a HF config's weights (norms: (cols,); a mixture's stacked experts: (experts,
    rows, cols))."""
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, ff = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    shapes = {"token_embd.weight": (c["vocab_size"], h), "output_norm.weight": (h,), "output.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,), p + "attn_q.weight": (q, h),
                       p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, q)})
        if c["model_type"] in ("qwen3", "qwen3_moe"):
            shapes.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if c["model_type"] == "qwen3_moe":  # every layer sparse, as llama.cpp's qwen3moe requires
            e, moe = c["num_experts"], c["moe_intermediate_size"]
            shapes.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, moe, h),
                           p + "ffn_up_exps.weight": (e, moe, h), p + "ffn_down_exps.weight": (e, h, moe)})
        else:
            shapes.update({p + "ffn_gate.weight": (ff, h), p + "ffn_up.weight": (ff, h), p + "ffn_down.weight": (h, ff)})
    return shapes


F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")  # as llama.cpp keeps them


def _hybrid_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """_tensors of a Qwen3.5 MoE config, named as llama.cpp's qwen35moe (weights/gguf_hybrid.py reads them back):
    Gated DeltaNet layers (attn_qkv, attn_gate, ssm_*), gated full attention (attn_q twice as wide: the output gate),
    and in every layer routed experts beside a shared expert."""
    h, hd, e = c["hidden_size"], c["head_dim"], c["num_experts"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    value = hv * c["linear_value_head_dim"]
    conv = 2 * hk * c["linear_key_head_dim"] + value
    moe, shared = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    shapes = {"token_embd.weight": (c["vocab_size"], h), "output_norm.weight": (h,), "output.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "post_attention_norm.weight": (h,)})
        if (i + 1) % c["full_attention_interval"] == 0:
            shapes.update({p + "attn_q.weight": (2 * q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                           p + "attn_output.weight": (h, q), p + "attn_q_norm.weight": (hd,),
                           p + "attn_k_norm.weight": (hd,)})
        else:
            shapes.update({p + "attn_qkv.weight": (conv, h), p + "attn_gate.weight": (value, h),
                           p + "ssm_beta.weight": (hv, h), p + "ssm_alpha.weight": (hv, h),
                           p + "ssm_conv1d.weight": (conv, c["linear_conv_kernel_dim"]), p + "ssm_a": (hv,),
                           p + "ssm_dt.bias": (hv,), p + "ssm_norm.weight": (c["linear_value_head_dim"],),
                           p + "ssm_out.weight": (h, value)})
        shapes.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, moe, h),
                       p + "ffn_up_exps.weight": (e, moe, h), p + "ffn_down_exps.weight": (e, h, moe),
                       p + "ffn_gate_shexp.weight": (shared, h), p + "ffn_up_shexp.weight": (shared, h),
                       p + "ffn_down_shexp.weight": (h, shared), p + "ffn_gate_inp_shexp.weight": (1, h)})
    return shapes


def _add_hybrid_metadata(writer, c: dict):
    """The qwen35moe.* keys that gguf_hybrid.config_kwargs reads, and the rotary sections transformers' GGUF reader
    asks for (the tokenizer loads through it)."""
    arch = "qwen35moe"
    recurrent = [(i + 1) % c["full_attention_interval"] != 0 for i in range(c["num_hidden_layers"])]
    rotary = int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"])
    for key, value in {"ssm.conv_kernel": c["linear_conv_kernel_dim"], "ssm.state_size": c["linear_key_head_dim"],
                       "ssm.group_count": c["linear_num_key_heads"], "ssm.time_step_rank": c["linear_num_value_heads"],
                       "ssm.inner_size": c["linear_num_value_heads"] * c["linear_value_head_dim"],
                       "full_attention_interval": c["full_attention_interval"],
                       "rope.dimension_count": rotary,
                       "expert_shared_feed_forward_length": c["shared_expert_intermediate_size"]}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    half = rotary // 2  # the multimodal rotary's sections, as Qwen3.5's files have them
    writer.add_array(f"{arch}.rope.dimension_sections", [half - 2 * (half // 3), half // 3, half // 3, 0])


def _vector(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A 1-D tensor: norms near 1; a hybrid's ssm_a (-exp(A_log)) negative, its dt bias near 0."""
    if name.endswith("ssm_a"):
        return -(0.5 + rng.random(dims)).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return (0.1 * rng.standard_normal(dims)).astype(np.float32)
    return (1 + 0.1 * rng.standard_normal(dims)).astype(np.float32)


def write_gguf(shape: str | dict, type_name: str, path: str, tokenizer: str | None = None, seed: int = 0) -> Path:
    """Write a random-weight GGUF of `shape` (a name of synthetic.SHAPES or a HF config dict) whose weight
    matrices are `type_name` blocks (norms F32); the vocabulary is the tokenizer donor's."""
    import gguf

    from nanovllm.weights.bundled import bundled_model_path

    c = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    if type_name not in FORMATS:
        raise ValueError(f"GGUF type {type_name!r} has no writer; choose one of {', '.join(FORMATS)}")
    if c["model_type"] not in ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_moe_text") or c.get("rope_scaling"):
        raise ValueError(f"synthetic GGUF files are plain llama / qwen2 / qwen3 / qwen3_moe models or Qwen3.5 MoE "
                         f"hybrids, got {c['model_type']}")
    hybrid = c["model_type"] == "qwen3_5_moe_text"
    shapes = _hybrid_tensors if hybrid else _tensors
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise ValueError("synthetic qwen3moe GGUF files have experts in every layer (llama.cpp's qwen3moe)")
    block = FORMATS[type_name].block_size
    odd = sorted({dims[-1] for name, dims in shapes(c).items() if len(dims) >= 2 and dims[-1] % block
                  and not name.endswith(F32_TENSORS)})
    if odd:
        raise ValueError(f"{type_name} rows are whole blocks of {block} weights; this shape has rows of {odd}")
    donor = gguf.GGUFReader(tokenizer or bundled_model_path())
    c["vocab_size"] = len(donor.fields["tokenizer.ggml.tokens"].data)
    arch = "qwen35moe" if hybrid else c["model_type"].replace("_", "")  # qwen3_moe: qwen3moe
    writer = gguf.GGUFWriter(str(path), arch)
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    if not hybrid:  # Qwen3.5 MoE has no dense MLP
        writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_freq_base(c["rope_parameters"]["rope_theta"] if hybrid else c["rope_theta"])
    writer.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(c["vocab_size"])
    if hybrid:
        _add_hybrid_metadata(writer, c)
    if arch in ("qwen3moe", "qwen35moe"):
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    copy_tokenizer_metadata(donor, writer)
    rng = np.random.default_rng(seed)
    for name, dims in shapes(c).items():
        if len(dims) == 1:
            writer.add_tensor(name, _vector(name, dims, rng))
            continue
        kind = "F32" if name.endswith(F32_TENSORS) else type_name  # the routers: F32, as llama.cpp's
        std = (2 if name == "token_embd.weight" else 1) / math.sqrt(dims[-1])
        data = random_blocks(kind, math.prod(dims[:-1]), dims[-1], std, rng)
        data = data.reshape(*dims[:-1], -1)  # stacked experts: [experts, rows, row bytes]
        raw_dtype = None if data.dtype != np.uint8 else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("type", choices=sorted(FORMATS))
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=None, help="a GGUF file whose tokenizer to copy (default: the bundled model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_gguf(args.shape, args.type, args.out, args.tokenizer, args.seed))
