"""Programmatic dependent launch (Hopper and newer): a kernel is launched while the one before it in the stream
is finishing, so its launch latency hides behind that kernel's tail. Each kernel launched this way calls
gdc_wait() before it touches memory (it returns once the previous kernel has completed and its writes are
visible), then gdc_launch_dependents() to let the next kernel launch. NANOVLLM_PDL=0 turns it off.

Whether it runs is decided per device at the first launch, not at import, so importing nanovllm never
initializes CUDA; every kernel takes the decision as its PDL constexpr."""
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """The first statement of every kernel: under PDL, wait for the previous kernel, then let the next launch.
    Without it the branch is not compiled, so GPUs before Hopper never see the instructions."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def not_hopper(device: torch.device) -> str | None:
    """None on an NVIDIA GPU of Hopper or newer (compiled kernels run there), else what it is instead."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip:
        return "no CUDA GPU"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "the GPU predates Hopper"
    return None


def why_off(device: torch.device) -> str | None:
    """None when PDL can run on this device, else the reason it does not."""
    if os.environ.get("NANOVLLM_PDL", "1") == "0":
        return "NANOVLLM_PDL=0"
    if (reason := not_hopper(device)) is not None:
        return reason
    if not HAS_GDC:
        return f"Triton {triton.__version__} has no griddepcontrol"
    return None


_launch_options: dict[str, dict] = {}


def pdl_launch(device: torch.device) -> dict:
    """Extra launch arguments for a kernel on `device`: its PDL constexpr, and launch_pdl when on."""
    key = str(device)
    if key not in _launch_options:
        on = why_off(device) is None
        _launch_options[key] = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    return _launch_options[key]
