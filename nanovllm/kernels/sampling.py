"""Seeded categorical sampling in one pass over the logits: argmax(logits / temperature - log E), E ~ Exp(1)
drawn from a counter-based hash of (seed, step, token id); a row at temperature 0 takes the plain argmax.
The logits are read in the model's dtype, so the common case (temperature only) costs one read of them. A
batch of few rows splits each row's vocabulary over several programs; the row's last program to finish merges
their best scores (a per-row counter, back at zero after each launch), so the draw is one kernel.
Compiled, log E takes two hardware lg2 approximations (_log_exponential); the reference computes it with exact
logs, so a draw can differ only where two scores are within ~3e-6. Reference: layers.sampler.gumbel_argmax_reference."""
import os

import torch
import triton
import triton.language as tl

from nanovllm.kernels import num_sms
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
def _lg2_approx(x):
    """The SFU's log2: 2^-22 absolute error on [0.5, 2], 2 ulp elsewhere."""
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _log_exponential(bits, FAST: tl.constexpr):
    """log E, E = -log(u) ~ Exp(1) for u = ((bits >> 9) + 0.5) / 2^23, as layers.sampler.log_exponential_noise.
    FAST: lg2 approximations instead of two libdevice logs (~60 instructions an element). Where u > 15/16, lg2's
    absolute error would be large against E ~ 1 - u, so E there is the series of -log(1 - v) in v = 1 - u (exact
    in fp32); E's relative error stays below ~3e-6, and so does log E's absolute error."""
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if not FAST:
        return tl.log(-tl.log(uniform))
    v = 1.0 - uniform
    near_one = v * (1.0 + v * (0.5 + v * (0.3333333333 + v * (0.25 + v * (0.2 + v * 0.1666666667)))))
    e = tl.where(v < 0.0625, near_one, -0.6931471805599453 * _lg2_approx(uniform))
    return 0.6931471805599453 * _lg2_approx(e)


@triton.jit(do_not_specialize=["num_splits"])  # one compiled kernel for every split count: none mid-run
def _gumbel_argmax_kernel(logits_ptr, seeds_ptr, steps_ptr, temp_ptr, out_ptr, part_score_ptr, part_idx_ptr,
                          counter_ptr, vocab, stride, split_len, num_splits, HAS_TEMPERATURE: tl.constexpr,
                          BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, vocabulary split): the best score of its split and where it is; the row's last
    program to finish picks the best split's."""
    wait_then_release(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temp_ptr + row).to(tl.float32) if HAS_TEMPERATURE else 1.0
    inverse = tl.math.div_rn(1.0, tl.where(temperature > 0, temperature, 1.0))  # as the reference's reciprocal
    seed = tl.load(seeds_ptr + row).to(tl.uint32)
    step = tl.load(steps_ptr + row).to(tl.uint32)
    key = _mix32(seed ^ _mix32(step + 0x3C6EF372))
    begin = split * split_len
    end = tl.minimum(begin + split_len, vocab)
    # each lane keeps its best score and where (strict >: its earliest); one reduction after the loop
    lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_idx = tl.full([BLOCK], begin, tl.int32)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < end
        logit = tl.load(logits_ptr + row * stride + offs, mask=ok, other=float("-inf")).to(tl.float32)
        noise = _log_exponential(_mix32(key + offs.to(tl.uint32) * tl.full([], 0x9E3779B9, tl.uint32)), FAST_LOG)
        if HAS_TEMPERATURE:  # as the reference: times 1 / temperature, then subtract log E
            logit = tl.where(temperature > 0, logit * inverse - noise, logit)
        else:
            logit = logit - noise
        score = tl.where(ok, logit, float("-inf"))
        better = score > lane_best
        lane_best = tl.where(better, score, lane_best)
        lane_idx = tl.where(better, offs, lane_idx)
    best = tl.max(lane_best, 0)
    best_idx = tl.min(tl.where(lane_best == best, lane_idx, vocab), 0)  # ties: the earliest, as torch.argmax
    if num_splits == 1:
        tl.store(out_ptr + row, best_idx)
    else:
        tl.store(part_score_ptr + row * num_splits + split, best)
        tl.store(part_idx_ptr + row * num_splits + split, best_idx)
        tl.debug_barrier()  # the partials are stored before the count that releases them
        if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel") == num_splits - 1:
            s = tl.arange(0, MAX_SPLITS)
            # through L2 (.cg): this SM's L1 may hold the partials of an earlier launch at these addresses
            scores = tl.load(part_score_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"),
                             cache_modifier=".cg")
            winner = tl.argmax(scores, 0, tie_break_left=True)  # ties: the earliest split, which holds the earlier ids
            tl.store(out_ptr + row, tl.load(part_idx_ptr + row * num_splits + winner, cache_modifier=".cg"))
            tl.store(counter_ptr + row, 0)  # ready for the next launch


def _block() -> int:
    return 256 if INTERPRETED else 2048


MAX_SPLITS = 64


def sample_num_splits(rows: int, vocab: int, num_sms: int) -> int:
    """Vocabulary splits per row: about four programs per SM, so that a few rows still use the whole GPU (one
    program reading a 150K vocabulary alone takes ~100 us on the H100), and at least one block per split."""
    wanted = triton.next_power_of_2(triton.cdiv(4 * num_sms, rows))
    most = 1 << (triton.cdiv(vocab, _block()).bit_length() - 1)  # the largest power of two <= the block count
    return max(1, min(wanted, most, MAX_SPLITS))


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  temperature: torch.Tensor | None = None, num_splits: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] (filtered entries -inf) -> sampled token ids [B] int64 (into `out` if given). With
    `temperature` [B], the logits are multiplied by its reciprocal first, and rows at 0 are greedy. num_splits:
    vocabulary splits per row (default: sample_num_splits); their best scores merge in a second kernel."""
    assert logits.stride(1) == 1
    rows, vocab = logits.shape
    splits = num_splits or sample_num_splits(rows, vocab, num_sms(logits.device))
    assert 1 <= splits <= MAX_SPLITS
    block = _block()
    split_len = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    # the workspaces exist even unused (one split), so that one compiled kernel serves every split count
    part_score = torch.empty(rows * splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows * splits, dtype=torch.int64, device=logits.device)
    has_temperature = temperature is not None
    _gumbel_argmax_kernel[(rows, splits)](logits, seeds, steps, temperature if has_temperature else seeds, out,
                                          part_score, part_idx, _row_counters(rows, logits.device), vocab,
                                          logits.stride(0), split_len, splits, HAS_TEMPERATURE=has_temperature,
                                          BLOCK=block, FAST_LOG=not INTERPRETED, MAX_SPLITS=MAX_SPLITS, num_warps=8,
                                          **pdl_launch(logits.device))
    return out


_counters: dict[str, list[torch.Tensor]] = {}


def _row_counters(rows: int, device: torch.device) -> torch.Tensor:
    """The kernel's per-row counts of finished splits: zeros, kept per device (each launch leaves them at zero),
    made before any CUDA graph capture (the warm-up steps sample first) and never inside one. A larger batch gets
    new counters; the old stay allocated, since graphs captured before may still use them."""
    kept = _counters.setdefault(str(device), [])
    if not kept or kept[-1].numel() < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gumbel_argmax: {rows} rows in a CUDA graph capture, more than any eager step had")
        kept.append(torch.zeros(max(rows, 1024), dtype=torch.int32, device=device))
    return kept[-1]
