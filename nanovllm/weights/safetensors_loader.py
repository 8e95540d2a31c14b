from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
    return files


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from every shard, memory-mapped; a corrupt shard names itself."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"corrupt or truncated safetensors file {path}: {e}") from e
