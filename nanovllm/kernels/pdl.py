"""Programmatic dependent launch (Hopper and newer): a kernel is launched while the one before it in the stream
is finishing, so its launch latency hides behind that kernel's tail. Each kernel launched this way calls
gdc_wait() before it touches memory (it returns once the previous kernel has completed and its writes are
visible), then gdc_launch_dependents() to let the next kernel launch. NANOVLLM_PDL=0 turns it off."""
import os

import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter looks it up in a jit function's globals)


def _why_off() -> str | None:
    """None when PDL can run here, else the reason it does not."""
    if os.environ.get("NANOVLLM_PDL", "1") == "0":
        return "NANOVLLM_PDL=0"
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() or torch.version.hip:
        return "no CUDA GPU"
    if torch.cuda.get_device_capability()[0] < 9:
        return "the GPU predates Hopper"
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return f"Triton {triton.__version__} has no griddepcontrol"
    return None


OFF_REASON = _why_off()
ENABLED = OFF_REASON is None
LAUNCH = {"launch_pdl": True} if ENABLED else {}  # extra launch options for every kernel that waits

if ENABLED:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_then_release():
    """The first statement of every kernel that runs under PDL."""
    gdc_wait()
    gdc_launch_dependents()
