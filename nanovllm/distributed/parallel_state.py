"""Tensor parallelism's process group: this process's rank and the group's size (0 and 1 without one), and the
collectives the sharded layers call. NCCL between GPUs, gloo between CPU processes; rank 0's step commands go over
a gloo group either way (host objects)."""
import datetime
import os

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=5)  # a collective that waits longer fails (a stuck rank) instead of hanging

_rank, _size, _control = 0, 1, None


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device):
    global _rank, _size, _control
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=TIMEOUT)
    _control = dist.new_group(backend="gloo", timeout=TIMEOUT) if device.type == "cuda" else dist.group.WORLD
    _rank, _size = rank, size


def destroy_tensor_parallel():
    global _rank, _size, _control
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _control = 0, 1, None


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The sum (or op) over ranks, in place (x itself without a group)."""
    if _size > 1:
        dist.all_reduce(x, op=op)
    return x


def share_cpu_threads(processes: int):
    """Processes on one CPU split its cores (each would otherwise take them all)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x side by side along the last dim (a vocab-parallel LM head's logits)."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_command(command=None):
    """Rank 0's command (any picklable object) on every rank."""
    box = [command]
    dist.broadcast_object_list(box, src=0, group=_control)
    return box[0]


def local_part(total: int, what: str) -> int:
    """This rank's share of `total` heads / rows, which the ranks divide evenly."""
    if total % _size:
        raise ValueError(f"tensor_parallel_size={_size} does not divide the model's {total} {what}")
    return total // _size
