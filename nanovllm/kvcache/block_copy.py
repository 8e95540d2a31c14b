"""KV block copies between the device cache and the host pool as step inputs: the scheduler and block manager decide
them (swap out / in, offload, the prefix tier's stores and loads), the host pool lists them in order, and the model
runner executes the list at the start of the step that needs them (each tensor-parallel rank its own heads' part),
before that step's forward writes into any block they free."""
from dataclasses import dataclass, field

import torch

from nanovllm.comm.sgdma import copy_blocks

OUT, IN = "out", "in"  # device -> host pool, host pool -> device


@dataclass
class BlockCopy:
    direction: str  # OUT or IN
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)


def queue_copy(copies: list[BlockCopy], direction: str, src: list[int], dst: list[int]):
    """Append a copy, merged into the last one where it goes the same way and writes none of its blocks (one sgDMA
    call; a block written twice keeps the order of the writes)."""
    last = copies[-1] if copies else None
    if last is not None and last.direction == direction and set(dst).isdisjoint(last.dst):
        last.src += src
        last.dst += dst
    else:
        copies.append(BlockCopy(direction, list(src), list(dst)))


def run_block_copies(copies: list[BlockCopy], kv_cache: torch.Tensor, pool: torch.Tensor):
    """Every copy in order, queued on the current stream."""
    for copy in copies:
        source, target = (kv_cache, pool) if copy.direction == OUT else (pool, kv_cache)
        copy_blocks(source, target, copy.src, copy.dst)
