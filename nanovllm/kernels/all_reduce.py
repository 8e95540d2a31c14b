"""One-shot all-reduce of a small tensor between the GPUs of one host (distributed/custom_all_reduce.py): each rank
copies its tensor into its own buffer, which the others can read (CUDA IPC, over NVLink), raises a flag in each
peer's memory, waits for the peers' flags, and sums every rank's buffer in rank order, so every rank gets the same
bits. One kernel launch and one read of each peer: for the few KB of a decode step's hidden states it took 6.6 us
on two H100s inside a CUDA graph, against NCCL's 16.8 us (docs/benchmarks.md; that version, before programmatic
dependent launch and .cg loads, read its peers with scalar volatile loads).

Program p of each rank pairs with program p of the others: it counts its calls in epochs[p] (the ranks make the
same calls, so the counts agree) and flags a call by its count. Buffers alternate by the count's parity: a rank
writes a buffer again two calls later, by when every peer has flagged the call in between, so has finished reading
it. That holds because a part of the buffer always belongs to the same program, whatever the call's size: chunk c
of BLOCK elements goes to program c % MAX_PROGRAMS (a small call runs only the programs that have a chunk, and their
counts alone advance). Reference: all_reduce_reference."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release

BLOCK = 2048  # elements a program moves per iteration
MAX_PROGRAMS = 32  # few enough to be resident together on every GPU: a program spins until its peers arrive


@triton.jit
def _one_shot_kernel(x_ptr, n, data_ptrs, flag_ptrs, epochs_ptr, rank, slot_elems, WORLD: tl.constexpr,
                     MAX_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    p = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    epoch = tl.load(epochs_ptr + p) + 1
    slot = (epoch % 2).to(tl.int64) * slot_elems
    mine = tl.load(data_ptrs + rank).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
    for start in range(p * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
    tl.debug_barrier()  # the program's stores are done before its flag goes up (the release orders them)
    for q in tl.static_range(WORLD):
        if q != rank:
            peer_flags = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + rank * MAX_PROGRAMS + p, epoch, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != rank:
            seen = tl.atomic_add(my_flags + q * MAX_PROGRAMS + p, 0, sem="acquire", scope="sys")
            while seen < epoch:
                seen = tl.atomic_add(my_flags + q * MAX_PROGRAMS + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    for start in range(p * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            data = tl.load(data_ptrs + q).to(tl.pointer_type(x_ptr.dtype.element_ty)) + slot
            # past the acquire, plain vector loads see the peers' stores; .cg keeps them out of L1, which may hold
            # lines of this slot from two calls ago (volatile loads were scalar)
            total += tl.load(data + offs, mask=offs < n, other=0, cache_modifier=".cg").to(tl.float32)
        tl.store(x_ptr + offs, total.to(x_ptr.dtype.element_ty), mask=offs < n)
    tl.store(epochs_ptr + p, epoch)


def one_shot_all_reduce(x: torch.Tensor, data_ptrs: torch.Tensor, flag_ptrs: torch.Tensor, epochs: torch.Tensor,
                        rank: int, slot_elems: int) -> torch.Tensor:
    """x (contiguous, at most slot_elems elements) summed over the ranks, in place. data_ptrs / flag_ptrs: [world]
    int64 addresses of every rank's buffer ([2, slot_elems] of x's dtype) and flags ([world, MAX_PROGRAMS] int32);
    epochs: this rank's [MAX_PROGRAMS] int32 call counts."""
    n = x.numel()
    programs = min(triton.cdiv(n, BLOCK), MAX_PROGRAMS)
    _one_shot_kernel[(programs,)](x, n, data_ptrs, flag_ptrs, epochs, rank, slot_elems, WORLD=data_ptrs.shape[0],
                                  MAX_PROGRAMS=MAX_PROGRAMS, BLOCK=BLOCK, num_warps=4, **pdl_launch(x.device))
    return x


def all_reduce_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum the kernel gives every rank: fp32, in rank order, cast back."""
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)
