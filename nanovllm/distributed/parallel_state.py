"""Tensor parallelism's process group: this process's rank and the group's size (0 and 1 without one), and the
collectives the sharded layers call. Between GPUs they are NCCL calls on the current stream (distributed/pynccl.py:
the same calls run eagerly and inside CUDA graphs); between CPU processes, gloo. Rank 0's step commands (host
objects) always go over gloo."""
import datetime
import os
import socket

import torch
import torch.distributed as dist

from nanovllm.distributed.pynccl import NcclCommunicator
from nanovllm.logger import log_once

TIMEOUT = datetime.timedelta(minutes=5)  # a gloo call that waits longer fails (a stuck rank) instead of hanging
_GLOO_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

_rank, _size, _nccl, _custom = 0, 1, None, None


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def local_init_method() -> str:
    """A rendezvous address for a group on this host (a free port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         custom_all_reduce: bool = True):
    """custom_all_reduce: small all-reduces between GPUs run the one-shot kernel (where the GPUs reach each other's
    memory), the rest NCCL."""
    global _rank, _size, _nccl, _custom
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)
    if device.type == "cuda":
        from nanovllm.distributed.custom_all_reduce import CustomAllReduce, measure_max_bytes, why_not_custom  # Triton

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        unique_id = broadcast_command(NcclCommunicator.unique_id() if rank == 0 else None)
        _nccl = NcclCommunicator(rank, size, unique_id, device)
        why_not = "disable_custom_all_reduce=True" if not custom_all_reduce else why_not_custom(size)
        if why_not is None:
            _custom = CustomAllReduce(rank, size, device, _all_gather_object)
            max_bytes = measure_max_bytes(_custom, _nccl.all_reduce, _all_gather_object)
        log_once(f"all-reduces of up to {max_bytes >> 10} KiB between GPUs: the one-shot kernel over P2P, larger ones "
                 "NCCL" if why_not is None else f"all-reduces between GPUs run NCCL ({why_not})")
    _rank, _size = rank, size


def destroy_tensor_parallel():
    global _rank, _size, _nccl, _custom
    if _custom is not None:
        _custom.close()
    if _nccl is not None:
        _nccl.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _nccl, _custom = 0, 1, None, None


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The sum (or "min", "max") over ranks, in place (x itself without a group)."""
    if _size > 1:
        if _custom is not None and op == "sum" and _custom.can_run(x):
            _custom(x)
        elif _nccl is not None:
            _nccl.all_reduce(x, op)
        else:
            dist.all_reduce(x, op=_GLOO_OPS[op])
    return x


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank, in place."""
    if _size > 1:
        if _nccl is not None:
            _nccl.broadcast(x)
        else:
            dist.broadcast(x, src=0)
    return x


def share_cpu_threads(processes: int):
    """Processes on one CPU split its cores (each would otherwise take them all)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def all_gather_last_dim(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ranks' [rows, n] x side by side: [rows, size * n] (a vocab-parallel LM head's logits), into out if
    given."""
    if _size == 1:
        return x
    x = x.contiguous()
    parts = torch.empty(_size, *x.shape, dtype=x.dtype, device=x.device)
    if _nccl is not None:
        _nccl.all_gather(x, parts)
    else:
        dist.all_gather(list(parts.unbind(0)), x)
    gathered = parts.movedim(0, -2).reshape(*x.shape[:-1], _size * x.shape[-1])
    return gathered if out is None else out.copy_(gathered)


def _all_gather_object(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_command(command=None):
    """Rank 0's command (any picklable object) on every rank."""
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def local_part(total: int, what: str) -> int:
    """This rank's share of `total` heads / rows, which the ranks divide evenly."""
    if total % _size:
        raise ValueError(f"tensor_parallel_size={_size} does not divide the model's {total} {what}")
    return total // _size
