"""Log-probabilities: of the sampled tokens (SamplingParams.logprobs) and of every prompt token given the ones before
(prompt_logprobs, offline scoring), with their ranks and the top-k."""
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROMPT_LOGPROBS_CHUNK = 1024  # rows of [rows, vocab] fp32 logits alive at once while scoring prompts


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, and the top-k."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def gather_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Per row of [rows, vocab] log-probabilities: the target's logprob and rank (1 = most likely), and the top-k."""
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (chosen[:, :0], targets[:, None][:, :0])
    return [TokenLogprobs(t, c, r, ids, lps) for t, c, r, ids, lps in
            zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())]


def prompt_logprobs(seqs, hidden: torch.Tensor, starts: list[int], compute_logits: Callable,
                    to_device: Callable) -> list[list[TokenLogprobs]]:
    """For each of a step's sequences (`starts`: their first rows of `hidden`), the log-likelihood of each prompt
    token this step reaches given the ones before, PROMPT_LOGPROBS_CHUNK rows of logits at a time (never a whole
    [tokens, vocab] fp32 matrix for a long prompt)."""
    out: list[list[TokenLogprobs]] = [[] for _ in seqs]
    rows, targets, owners = [], [], []
    for i, seq in enumerate(seqs):
        if not seq.wants_prompt_logprobs:
            continue
        start = seq.num_computed_tokens
        end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
        for pos in range(start, end):
            rows.append(starts[i] + pos - start)
            targets.append(seq.token_ids[pos + 1])
            owners.append(i)
    k = max((seqs[i].params.prompt_logprobs for i in set(owners)), default=0)
    for c in range(0, len(rows), PROMPT_LOGPROBS_CHUNK):
        chunk = slice(c, c + PROMPT_LOGPROBS_CHUNK)
        logits = compute_logits(hidden[to_device(rows[chunk], torch.int64)])
        entries = gather_logprobs(logits.float().log_softmax(-1), to_device(targets[chunk], torch.int64), k)
        for owner, entry in zip(owners[chunk], entries):
            out[owner].append(entry)
    return out
