"""Every shipped Triton kernel launch compiles for the H100 (sm_90), checked on CPU: the interpreter that runs
the kernel tests here executes kernels without compiling them, so a compile-only error would first show on the
device (scripts/compile_check.py says more)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # compiles every kernel launch


def _has_sm90_compiler() -> bool:
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _has_sm90_compiler(), reason="this Triton has no CUDA backend with its ptxas")
def test_every_kernel_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "compile_check.py")
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " 0 failed" in result.stdout
