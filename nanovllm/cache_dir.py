import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """nanovllm's cache folder, NANOVLLM_CACHE (default ~/.cache/nanovllm), or a folder in it: built kernels,
    fetched models, tokenizers, weights offloaded to disk."""
    return Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"), *parts)
