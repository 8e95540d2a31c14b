import numpy as np
import torch


def to_device(array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array (a list or numpy array) as a tensor of dtype on device; on CUDA through pinned memory, without
    waiting for the copy."""
    t = torch.from_numpy(np.asarray(array, dtype=np.int64 if dtype == torch.int64 else None)).to(dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
