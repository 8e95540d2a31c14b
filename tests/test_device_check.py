"""scripts/device_check.sh's GPU test groups (tests1, tests2) name every test file that touches CUDA, so that a
device run of both groups leaves none of the GPU tests out."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_device_check_lists_every_cuda_test_file():
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    listed = set(re.findall(r"tests/(test_\w+\.py)", script))
    cuda_files = {path.name for path in (ROOT / "tests").glob("test_*.py") if "cuda" in path.read_text()}
    cuda_files.discard(pathlib.Path(__file__).name)
    assert cuda_files and cuda_files <= listed, f"not in scripts/device_check.sh: {sorted(cuda_files - listed)}"
