from nanovllm.attention.backend import AttentionBackend
from nanovllm.logger import log_once

BACKENDS = ("torch", "triton")


def _default(device: str) -> str:
    if not device.startswith("cuda"):
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        log_once("triton is not importable: attention runs the torch reference backend on the GPU")
        return "torch"
    return "triton"


def get_attention_backend(name: str | None, device: str, max_model_len: int) -> AttentionBackend:
    """The one place that picks the attention backend; the choice is logged once."""
    name = name or _default(device)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
    if name == "triton":
        if not device.startswith("cuda"):
            raise ValueError("attention_backend='triton' needs device='cuda'")
        from nanovllm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend(max_model_len)
    else:
        from nanovllm.attention.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend()
    log_once(f"attention backend: {backend.name} on {device}")
    return backend
