"""GGUF files through the `gguf` package: the HF config from the metadata, and tensors under HF names."""
import math
import os
import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch

from nanovllm.logger import log_once
from nanovllm.models.registry import GGUF_ARCHITECTURES
from nanovllm.quant import gguf_formats
from nanovllm.quant.gguf_weight import GGUFWeight
from nanovllm.weights import gguf_hybrid

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # a mixture of experts: the router, and every expert's projection stacked [experts, rows, cols]
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# Tensor types the `gguf` package dequantizes (others, e.g. Q8_1 or I8, are rejected when the file is opened).
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                   "TQ1_0", "TQ2_0", "MXFP4"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")


@lru_cache(maxsize=2)
def open_gguf(path: str):
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises many kinds on bad bytes
        raise ValueError(f"corrupt or truncated GGUF file {path}: {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name}) in {path}; "
                             f"supported: {', '.join(sorted(SUPPORTED_TYPES))}")
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"truncated GGUF file {path}: tensor {t.name} ends at byte "
                             f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_hf_config(path: str):
    """Build the transformers config that HF would make of this GGUF file."""
    import transformers

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; "
                         f"GGUF architectures supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    hf_arch = GGUF_ARCHITECTURES[arch]
    hybrid = arch in gguf_hybrid.ARCHITECTURES
    cls = transformers.Qwen3NextConfig if hybrid else getattr(transformers, hf_arch.replace("ForCausalLM", "Config"))
    key = lambda name, default=None: _field(reader, f"{arch}.{name}", default)  # noqa: E731
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    kwargs = dict(
        architectures=[hf_arch], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count"),
        num_attention_heads=heads, num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads), max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=key("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    if key("expert_count"):  # qwen3moe; llama.cpp renormalizes its top-k weights, as Qwen3-MoE's configs ask
        kwargs.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                      moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[i for i in range(key("block_count"))
                                                              if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names])
    if hybrid:
        kwargs.update(gguf_hybrid.config_kwargs(key, key("block_count")))
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        kwargs["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor"),
                                  "original_max_position_embeddings": key("rope.scaling.original_context_length")}
    config = cls(**kwargs)
    if "rope_freqs.weight" in tensor_names:  # llama3 scaling as stored by llama.cpp: per-frequency divisors
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config.rope_freq_factors = np.array(t.data, dtype=np.float32).tolist()
    return config


def copy_tokenizer_metadata(reader, writer):
    """A GGUF file's tokenizer.* metadata (a gguf.GGUFReader's) into a gguf.GGUFWriter."""
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row permutation of Q/K (as HF transformers does on load)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, hybrid: bool = False) -> str | None:
    """hybrid: a qwen3next file (weights/gguf_hybrid.py names its linear attention and shared expert)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None
    layer, piece, suffix = m.groups()
    names = {**_LAYER_NAMES, **gguf_hybrid.LAYER_NAMES} if hybrid else _LAYER_NAMES
    if hybrid and (parameter := gguf_hybrid.PARAMETERS.get(piece + (f".{suffix}" if suffix else ""))):
        return f"model.layers.{layer}.{parameter}"
    if piece in names and suffix:
        return f"model.layers.{layer}.{names[piece]}.{suffix}"
    return None


def _read_bytes(file, t) -> torch.Tensor:
    """A tensor's bytes read from the file (a copy: reading through the reader's map would leave the whole file
    resident beside the copies, twice the memory)."""
    file.seek(t.data_offset)
    return torch.from_numpy(np.fromfile(file, dtype=np.uint8, count=int(t.n_bytes)))


def _load_tensor(file, t, keep_quantized: bool) -> torch.Tensor | GGUFWeight:
    """A GGUF tensor in numpy's dimension order: its blocks (GGUFWeight) where it stays quantized, else float32,
    by the torch twin of the kernels (gguf_formats) where the type has one, else by the gguf package."""
    type_name = t.tensor_type.name
    shape = [int(n) for n in reversed(t.shape)]
    quantized = type_name not in gguf_formats.DENSE_TYPES
    if quantized and keep_quantized and type_name in gguf_formats.FORMATS and len(shape) in (2, 3):
        # a mixture's stacked experts [E, N, K] as one weight of E x N rows
        return GGUFWeight.from_blocks(_read_bytes(file, t), type_name, (math.prod(shape[:-1]), shape[-1]))
    if quantized:
        log_once(f"GGUF {type_name} tensors are dequantized at load" +
                 (" (no kernel keeps this type quantized yet)" if keep_quantized else ""))
    if type_name in gguf_formats.FORMATS:
        return gguf_formats.dequantize(_read_bytes(file, t), type_name, shape[-1]).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    # a copy: GGUF data is a read-only map
    return torch.from_numpy(np.array(dequantize(t.data, GGMLQuantizationType(t.tensor_type)), dtype=np.float32))


def iterate_gguf(path: str, hf_config, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yield (HF name, tensor): quantized weights as their blocks (GGUFWeight) when keep_quantized, everything else
    dequantized to fp32; Q/K un-permuted for llama-family files."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    permuted, hybrid = arch == "llama", arch in gguf_hybrid.ARCHITECTURES
    with open(path, "rb") as file:
        for t in reader.tensors:
            name = _hf_name(t.name, hybrid)
            if name is None:
                if t.name == "rope_freqs.weight":
                    continue
                raise ValueError(f"unexpected tensor {t.name!r} in GGUF file {path}")
            tensor = _load_tensor(file, t, keep_quantized)
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
                unpermute = lambda rows: _unpermute_qk(rows, heads)  # noqa: E731
                tensor = tensor.map_rows(unpermute) if isinstance(tensor, GGUFWeight) else unpermute(tensor)
            if hybrid:
                yield from gguf_hybrid.hf_tensors(name, tensor, hf_config, tiled=arch != "qwen3next")
            else:
                yield name, tensor
    # the weights are read: let the reader go (it holds a numpy view of every metadata item, ~100 MB of Python
    # objects for a 49K-token vocabulary, and its map of the file)
    del reader
    open_gguf.cache_clear()
