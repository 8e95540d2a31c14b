import logging

import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.logger import log_once
from nanovllm.platform import FLASH_ATTN_DTYPES, FLASH_ATTN_PAGE, flash_attn_available

BACKENDS = ("torch", "triton", "flash_attn")


def _default(device: str, block_size: int, dtype: torch.dtype) -> str:
    if not device.startswith("cuda"):
        return "torch"
    if flash_attn_available():
        if dtype not in FLASH_ATTN_DTYPES:
            log_once(f"flash_attn is importable, but runs float16 and bfloat16 only (dtype={dtype}): attention runs "
                     "the triton backend")
        elif block_size % FLASH_ATTN_PAGE == 0:
            return "flash_attn"
        else:
            log_once(f"flash_attn is importable, but its paged kernels need block_size a multiple of {FLASH_ATTN_PAGE} "
                     f"(block_size={block_size}): attention runs the triton backend")
    try:
        import triton  # noqa: F401
    except ImportError:
        log_once("triton is not importable: attention runs the torch reference backend on the GPU")
        return "torch"
    return "triton"


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
