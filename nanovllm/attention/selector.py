from nanovllm.attention.backend import AttentionBackend
from nanovllm.logger import log_once

BACKENDS = ("torch",)


def get_attention_backend(name: str | None, device: str) -> AttentionBackend:
    """The one place that picks the attention backend; the choice is logged once."""
    if name is None:
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {name!r}")
    from nanovllm.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend()
    log_once(f"attention backend: {backend.name} on {device}")
    return backend
