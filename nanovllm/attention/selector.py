import logging

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.logger import log_once

BACKENDS = ("torch", "triton", "flash_attn")


def _default(device: str, block_size: int, dtype: torch.dtype) -> str:
    if not device.startswith("cuda"):
        return "torch"
    from nanovllm.attention.flash_attn_backend import DTYPES, PAGE_MULTIPLE, flash_attn_available

    if flash_attn_available():
        if dtype not in DTYPES:
            log_once(f"flash_attn is importable, but runs float16 and bfloat16 only (dtype={dtype}): attention runs "
                     "the triton backend")
        elif block_size % PAGE_MULTIPLE == 0:
            return "flash_attn"
        else:
            log_once(f"flash_attn is importable, but its paged kernels need block_size a multiple of {PAGE_MULTIPLE} "
                     f"(block_size={block_size}): attention runs the triton backend")
    try:
        import triton  # noqa: F401
    except ImportError:
        log_once("triton is not importable: attention runs the torch reference backend on the GPU")
        return "torch"
    return "triton"


def default_block_size(device: str, attention_backend: str | None, dtype: torch.dtype) -> int:
    """KV block size when the user gives none: flash_attn's paged kernels need 256, the others take vLLM's 16."""
    from nanovllm.attention.flash_attn_backend import DTYPES, PAGE_MULTIPLE, flash_attn_available

    wants_flash = attention_backend == "flash_attn" or (attention_backend is None and device.startswith("cuda")
                                                        and dtype in DTYPES)
    return PAGE_MULTIPLE if wants_flash and flash_attn_available() else 16


def get_attention_backend(name: str | None, device: str, max_model_len: int, block_size: int,
                          dtype: torch.dtype) -> AttentionBackend:
    """The one place that picks the attention backend; the choice is logged once."""
    name = name or _default(device, block_size, dtype)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
    if name != "torch" and not device.startswith("cuda"):
        raise ValueError(f"attention_backend={name!r} needs device='cuda'")
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend(max_model_len, torch.device(device))
    elif name == "flash_attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend

        backend = FlashAttnBackend(block_size, dtype, max_model_len, torch.device(device))
    else:
        from nanovllm.attention.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend()
    log_once(f"attention backend: {backend.name} on {device}", logging.DEBUG)
    return backend
