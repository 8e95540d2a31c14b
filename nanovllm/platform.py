"""What this machine's devices can run, probed without building anything: the facts Config's defaults and checks
need (vLLM's platform layer, in short)."""
import functools

import torch

FLASH_ATTN_PAGE = 256  # flash_attn's paged kernels take KV blocks of a multiple of this many tokens
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)  # what its kernels run


@functools.cache
def flash_attn_available() -> bool:
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except ImportError:
        return False
    return True


def default_block_size(device: str, attention_backend: str | None, dtype: torch.dtype) -> int:
    """KV block size when the user gives none: flash_attn's paged kernels need 256, the others take vLLM's 16."""
    wants_flash = attention_backend == "flash_attn" or (attention_backend is None and device.startswith("cuda")
                                                        and dtype in FLASH_ATTN_DTYPES)
    return FLASH_ATTN_PAGE if wants_flash and flash_attn_available() else 16


def why_no_fp8(device: torch.device) -> str | None:
    """None where quantization='fp8' can run on this device, else why not."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"quantization='fp8' needs FP8 tensor cores (compute capability 8.9+, Ada or Hopper); {name} lacks them"
    return None
