from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
