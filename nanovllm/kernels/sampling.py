"""Seeded categorical sampling in one pass over the logits: argmax(logits / temperature - log E), E ~ Exp(1)
drawn from a counter-based hash of (seed, step, token id); a row at temperature 0 takes the plain argmax.
The logits are read in the model's dtype, so the common case (temperature only) costs one read of them.
Reference: layers.sampler.gumbel_argmax_reference."""
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # numpy runs the kernel: small blocks are faster


@triton.jit
def _mix32(x):
    # uint32: products wrap mod 2**32 and shifts are logical, the bits of the torch reference's int32 arithmetic
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, seeds_ptr, steps_ptr, temp_ptr, out_ptr, vocab, stride,
                          HAS_TEMPERATURE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0)
    temperature = tl.load(temp_ptr + row).to(tl.float32) if HAS_TEMPERATURE else 1.0
    divisor = tl.where(temperature > 0, temperature, 1.0)
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    step = tl.load(steps_ptr + row).to(tl.uint32)
    key = _mix32(seed ^ _mix32(step + 0x3C6EF372))
    best = float("-inf")
    best_idx = 0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < vocab
        logit = tl.load(logits_ptr + row * stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
        bits = _mix32(key + offs.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32))
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if HAS_TEMPERATURE:  # as the reference: divide (correctly rounded), then add the noise
            logit = tl.where(temperature > 0, tl.math.div_rn(logit, divisor) - tl.log(-tl.log(uniform)), logit)
        else:
            logit = logit - tl.log(-tl.log(uniform))
        score = tl.where(ok, logit, float("-inf"))
        block_best = tl.max(score, 0)
        if block_best > best:  # strict: ties keep the earliest index, as torch.argmax
            best = block_best
            best_idx = start + tl.argmax(score, 0)
    tl.store(out_ptr + row, best_idx)


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] (filtered entries -inf) -> sampled token ids [B] int64. With `temperature` [B], the
    logits are divided by it first, and rows at 0 are greedy."""
    assert logits.stride(1) == 1
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    has_temperature = temperature is not None
    _gumbel_argmax_kernel[(logits.shape[0],)](logits, seeds, steps, temperature if has_temperature else seeds, out,
                                              logits.shape[1], logits.stride(0), HAS_TEMPERATURE=has_temperature,
                                              BLOCK=256 if INTERPRETED else 2048, num_warps=8, **pdl_launch(logits.device))
    return out
