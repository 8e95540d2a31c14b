import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, which the split counts of the kernels aim to fill; 4 for the
    CPU, where the kernels run under the Triton interpreter."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
