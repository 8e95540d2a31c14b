"""Batched sampling on device tensors: every SamplingParams knob is a [B] tensor, no per-row Python.

Randomness comes from a counter-based hash of (sequence seed, output position, token id), so a seeded
request draws the same tokens whatever else is in the batch, and after a preemption too."""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.device_arrays import to_device


def _uint32_bits(x: torch.Tensor) -> torch.Tensor:
    """Values in [0, 2**32) as int32 tensors holding the same 32 bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, in place on int32 tensors read as uint32: products wrap mod 2**32 as uint32's
    would, and each shift masks off the sign bits that an int32 shift brings in. Half the memory traffic of
    int64, which makes it twice as fast on CPU; the bits equal the Triton kernel's uint32 arithmetic."""
    x ^= (x >> 16) & 0xFFFF
    x.mul_(0x7FEB352D)
    x ^= (x >> 15) & 0x1FFFF
    x.mul_(0x2C1B3C6D)
    x ^= (x >> 16) & 0xFFFF
    return x


_token_terms: dict = {}  # (vocab size, device) -> token id * golden ratio constant, mod 2**32, as int32 bits


def _token_term(vocab_size: int, device) -> torch.Tensor:
    key = (vocab_size, str(device))
    if key not in _token_terms:
        _token_terms[key] = _uint32_bits((torch.arange(vocab_size, device=device, dtype=torch.int64) * 0x9E3779B9)
                                         & 0xFFFFFFFF)
    return _token_terms[key]


def log_exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log E for Exp(1) noise E [B, V], a pure function of (seed, step, token id). Every op but the first runs
    in place on one [B, V] buffer: on CPU this is a large share of a sampled decode step."""
    key = _mix32(_uint32_bits(seeds) ^ _mix32(_uint32_bits(steps + 0x3C6EF372)))
    bits = _mix32(key[:, None] + _token_term(vocab_size, seeds.device)[None, :])
    # u from 23 bits: k + 0.5 is exact in fp32, so u stays inside (0, 1). From 24, the largest k rounded to u = 1,
    # E = 0: a token drawn at an infinite score, whatever its probability (~1% of draws over a 150K vocabulary)
    uniform = ((bits >> 9) & 0x7FFFFF).float().add_(0.5).mul_(1.0 / (1 << 23))
    return uniform.log_().neg_().log_()


def temperature_reciprocal(temperature: torch.Tensor) -> torch.Tensor:
    """1 / temperature (1 for greedy rows): logits are multiplied by it, one multiply an element instead of a
    correctly rounded divide (13% of the fused sampling kernel's time at 224 x 151,936 on the H100)."""
    return torch.where(temperature > 0, temperature, 1.0).float().reciprocal()


def gumbel_argmax_reference(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                            temperature: torch.Tensor | None = None) -> torch.Tensor:
    """A categorical draw from softmax(logits) per row: argmax(logits - log E), E ~ Exp(1). With `temperature`,
    from softmax(logits * (1 / temperature)), and rows at temperature 0 take the argmax."""
    logits = logits.float()
    if temperature is None:
        return (logits - log_exponential_noise(seeds, steps, logits.shape[-1])).argmax(-1)
    greedy = logits.argmax(-1)
    scaled = logits * temperature_reciprocal(temperature)[:, None]
    sampled = (scaled - log_exponential_noise(seeds, steps, logits.shape[-1])).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


@dataclass
class SamplingTensors:
    temperature: torch.Tensor        # [B] float, 0 = greedy
    top_p: torch.Tensor              # [B] float
    top_k: torch.Tensor              # [B] int64, vocab size = off
    min_p: torch.Tensor              # [B] float
    seeds: torch.Tensor              # [B] int64 in [0, 2**32)
    steps: torch.Tensor              # [B] int64: output tokens so far
    presence_penalty: torch.Tensor   # [B] float
    frequency_penalty: torch.Tensor  # [B] float
    repetition_penalty: torch.Tensor  # [B] float
    output_counts: torch.Tensor | None  # [B, V] float counts of output tokens (only with penalties)
    prompt_mask: torch.Tensor | None   # [B, V] bool: token occurs in the prompt (only with penalties)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf: min_tokens
    all_greedy: bool
    any_top_k_p: bool
    any_min_p: bool
    max_logprobs: int  # largest top-k logprobs asked for; -1 = none

    @property
    def steady(self) -> bool:
        """Knobs that stay the same from step to step but the steps counter: no penalties (they count the output
        tokens), no min_tokens bans, no logprobs."""
        return self.output_counts is None and self.banned is None and self.max_logprobs < 0

    @property
    def temperature_only(self) -> bool:
        """No knob but temperature: sampling is one fused pass over the logits."""
        return self.steady and not self.any_top_k_p and not self.any_min_p


def prepare_sampling(seqs, vocab_size: int, stop_token_ids: list[int], device: torch.device) -> SamplingTensors:
    """The knobs of seqs' SamplingParams (and their seeds and output counts) as [B] tensors on device."""
    params = [s.params for s in seqs]
    # every per-row knob in two arrays: two host-to-device copies a step instead of eleven
    floats = to_device(np.array([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                                  p.repetition_penalty] for p in params], dtype=np.float32).T.copy(), torch.float32, device)
    ints = to_device(np.array([[p.top_k or vocab_size, s.seed, s.num_output_tokens] for p, s in zip(params, seqs)],
                              dtype=np.int64).T.copy(), torch.int64, device)
    counts = prompt_mask = None
    if any(p.has_penalties for p in params):
        counts, prompt_mask = _token_occurrences(seqs, vocab_size, device)
    banned_rows, banned_ids = [], []
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            stops = stop_token_ids + seq.params.stop_token_ids
            banned_rows += [row] * len(stops)
            banned_ids += stops
    banned = to_device(np.array([banned_rows, banned_ids], dtype=np.int64), torch.int64, device) if banned_rows else None
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingTensors(
        temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
        frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0], seeds=ints[1], steps=ints[2],
        output_counts=counts, prompt_mask=prompt_mask, banned=(banned[0], banned[1]) if banned_rows else None,
        all_greedy=all(p.greedy for p in params),
        any_top_k_p=any(p.top_k or p.top_p < 1 for p in params), any_min_p=any(p.min_p > 0 for p in params),
        max_logprobs=max(logprob_counts, default=-1))


def _token_occurrences(seqs, vocab_size: int, device: torch.device):
    """[B, V] counts of each output token and a mask of prompt tokens, built by scatter on device."""
    def occurrences(lists):
        ids = np.full((len(lists), max(1, max(len(x) for x in lists))), vocab_size, dtype=np.int64)
        for i, x in enumerate(lists):  # the pad id lands in a spare column
            ids[i, :len(x)] = x
        ids = to_device(ids, torch.int64, device)
        counts = torch.zeros(len(lists), vocab_size + 1, device=device)
        return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :-1]

    outputs = occurrences([s.output_token_ids for s in seqs])
    prompts = occurrences([s.token_ids[:s.num_prompt_tokens] for s in seqs]) > 0
    return outputs, prompts


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """vLLM's order: repetition (prompt and output tokens), then frequency and presence (output only)."""
    seen = t.prompt_mask | (t.output_counts > 0)
    rep = t.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalty[:, None] * t.output_counts
    return logits - t.presence_penalty[:, None] * (t.output_counts > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # probability mass strictly before each token
    drop |= (before > top_p[:, None]) & (ranks > 0)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


class Sampler:
    def __init__(self, use_triton: bool = False):
        self.draw = gumbel_argmax_reference
        if use_triton:
            from nanovllm.kernels.sampling import gumbel_argmax

            self.draw = gumbel_argmax

    def __call__(self, logits: torch.Tensor, t: SamplingTensors):
        """logits: [B, V] raw from the model, in its dtype. Returns (token ids [B], raw logprobs [B, V] or None)."""
        if t.temperature_only:  # an all-greedy batch needs no noise: torch's argmax
            return (logits.argmax(-1) if t.all_greedy else self.draw(logits, t.seeds, t.steps, t.temperature)), None
        logits = logits.float()
        logprobs = logits.log_softmax(-1) if t.max_logprobs >= 0 else None
        if t.banned is not None:
            logits = logits.index_put(t.banned, torch.tensor(float("-inf"), device=logits.device))
        if t.output_counts is not None:
            logits = apply_penalties(logits, t)
        greedy = logits.argmax(-1)
        if t.all_greedy:
            return greedy, logprobs
        logits = logits * temperature_reciprocal(t.temperature)[:, None]
        if t.any_min_p:
            probs = logits.softmax(-1)
            too_unlikely = probs < t.min_p[:, None] * probs.max(-1, keepdim=True).values
            logits = logits.masked_fill(too_unlikely, float("-inf"))
        if t.any_top_k_p:
            logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
        sampled = self.draw(logits, t.seeds, t.steps)
        return torch.where(t.temperature > 0, sampled, greedy), logprobs
