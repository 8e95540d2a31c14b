"""Where a model's config, tokenizer and weights come from: a HF directory or a single .gguf file; or, with
load_format="dummy" (vLLM's), a directory's config.json alone and weights drawn at random at load."""
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from nanovllm.cache_dir import cache_dir
from nanovllm.logger import log_once
from nanovllm.models.registry import resolve_architecture, text_config
from nanovllm.weights.gguf_loader import copy_tokenizer_metadata, gguf_hf_config, iterate_gguf
from nanovllm.weights.safetensors_loader import iterate_safetensors, safetensors_files

TOKENIZER_CACHE = cache_dir("tokenizers")
# architectures whose GGUF tokenizers older transformers cannot read -> one of the same tokenizer family it can
TOKENIZER_ALIASES = {"qwen3next": "qwen3", "qwen35": "qwen3", "qwen35moe": "qwen3"}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def model_format(model: str, load_format: str = "auto") -> str:
    """"gguf" (a .gguf file), "safetensors" (a HF directory) or "dummy" (a HF directory whose weights are drawn at
    load: its config.json alone is read)."""
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {model} (give a HF model directory or a .gguf file; "
                                "nanovllm never downloads from a hub)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {model} is not a .gguf file; give a .gguf file or a HF model directory")
        fmt = "gguf"
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {model} has no config.json")
    else:
        fmt = "dummy" if load_format == "dummy" else "safetensors"
    if load_format not in ("auto", fmt):
        raise ValueError(f"load_format={load_format!r} does not fit {model}: a .gguf file loads as 'gguf', a model "
                         "directory as 'safetensors' or 'dummy'")
    if fmt == "safetensors":
        safetensors_files(path)
    return fmt


def load_model_config(model: str, load_format: str = "auto"):
    """Return (HF config, format); unsupported architectures fail here, before any work."""
    from transformers import AutoConfig

    fmt = model_format(os.fspath(model), load_format)
    if fmt == "gguf":
        hf_config = gguf_hf_config(os.fspath(model))
    else:
        try:
            hf_config = AutoConfig.from_pretrained(model)
        except (ValueError, OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"cannot read {Path(model) / 'config.json'}: {e}") from e
    hf_config = text_config(hf_config)
    resolve_architecture(hf_config)
    return hf_config, fmt


def _gguf_tokenizer_cache_dir(path: str) -> Path:
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return TOKENIZER_CACHE / key


def load_tokenizer(model: str, tokenizer: str | None = None):
    """The HF tokenizer; for GGUF it is built from the file's metadata once, then cached on disk."""
    from transformers import AutoTokenizer

    source = tokenizer or model
    if not Path(source).exists():
        raise FileNotFoundError(f"tokenizer path does not exist: {source} (nanovllm never downloads from a hub)")
    if Path(source).suffix != ".gguf":  # a directory with a tokenizer, weights or not
        return AutoTokenizer.from_pretrained(source)
    cache = _gguf_tokenizer_cache_dir(source)
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    log_once(f"building the tokenizer from {source}'s GGUF metadata (cached in {cache})", logging.DEBUG)
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(source)), gguf_file=os.path.basename(source))
    except ValueError as e:  # "GGUF model with architecture ... is not supported yet"
        if "not supported" not in str(e):
            raise
        tok = _tokenizer_through_alias(source, cache)
    try:
        tok.save_pretrained(cache)
    except OSError:
        pass  # a read-only home only costs the rebuild next time
    return tok


def _tokenizer_through_alias(source: str, cache: Path):
    """The tokenizer of a GGUF file whose architecture this transformers cannot read: its tokenizer.* metadata copied
    into a tensorless GGUF of an architecture of the same tokenizer family, which it reads."""
    import gguf
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    if arch not in TOKENIZER_ALIASES:
        raise ValueError(f"this transformers cannot build the tokenizer of {source} (architecture {arch}); pass "
                         "tokenizer= a directory or GGUF file with the same tokenizer, or upgrade transformers")
    log_once(f"transformers cannot read {arch} GGUF tokenizers: {source}'s is read as {TOKENIZER_ALIASES[arch]}'s")
    cache.mkdir(parents=True, exist_ok=True)
    alias = cache / "tokenizer-only.gguf"
    writer = gguf.GGUFWriter(str(alias), TOKENIZER_ALIASES[arch])
    copy_tokenizer_metadata(reader, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return AutoTokenizer.from_pretrained(str(cache), gguf_file=alias.name)


def dummy_experts_type(config) -> str:
    """load_format="dummy" with quantization="gguf": experts in Q4_K blocks (the fused kernels' type) where their
    rows are whole 256-weight blocks, else Q8_0 (tiny test shapes)."""
    q4_k = config.hidden_size % 256 == 0 and config.moe_intermediate_size % 256 == 0
    type_name = "Q4_K" if q4_k else "Q8_0"
    log_once(f"load_format='dummy', quantization='gguf': the experts are random {type_name} blocks")
    return type_name


def iterate_weights(model_config, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight; "dummy" draws them on `device` (seed 0: every tensor-parallel rank draws
    the same values, and the values write_model writes with seed 0 on that device)."""
    if model_config.format == "dummy":
        from nanovllm.weights.synthetic import random_weights

        config = model_config.hf_config
        # transformers' attribute aliases (Qwen3-MoE's num_experts is num_local_experts) are absent from to_dict()
        aliases = {alias: getattr(config, alias) for alias in getattr(config, "attribute_map", {})}
        experts_type = dummy_experts_type(config) if model_config.quantization == "gguf" else None
        return random_weights({**config.to_dict(), **aliases}, model_config.dtype, device, experts_type=experts_type)
    if model_config.format == "gguf":
        return iterate_gguf(model_config.model, model_config.hf_config, model_config.quantization == "gguf")
    return iterate_safetensors(Path(model_config.model))
