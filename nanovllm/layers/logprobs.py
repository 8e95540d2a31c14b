"""Log-probabilities: of the sampled tokens (SamplingParams.logprobs) and of every prompt token given the ones before
(prompt_logprobs, offline scoring), with their ranks and the top-k."""
from dataclasses import dataclass

import torch

from nanovllm.device_arrays import to_device

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


class PromptScoring:
    """The log-likelihood of each prompt token a step reaches, given the ones before (offline scoring): the rows of
    the step's hidden states whose logits score them, PROMPT_LOGPROBS_CHUNK rows at a time (never a whole
    [tokens, vocab] fp32 matrix for a long prompt), and their entries per sequence as each chunk's logits arrive."""

    def __init__(self, seqs, starts: list[int]):
        """starts: each sequence's first row of the step's hidden states."""
        self.out: list[list[TokenLogprobs]] = [[] for _ in seqs]
        rows, self.targets, self.owners = [], [], []
        for i, seq in enumerate(seqs):
            if not seq.wants_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
            for pos in range(start, end):
                rows.append(starts[i] + pos - start)
                self.targets.append(seq.token_ids[pos + 1])
                self.owners.append(i)
        self.k = max((seqs[i].params.prompt_logprobs for i in set(self.owners)), default=0)
        self.row_chunks = [rows[c:c + PROMPT_LOGPROBS_CHUNK] for c in range(0, len(rows), PROMPT_LOGPROBS_CHUNK)]

    def add(self, chunk: int, logits: torch.Tensor):
        """The logits of row_chunks[chunk]."""
        part = slice(chunk * PROMPT_LOGPROBS_CHUNK, (chunk + 1) * PROMPT_LOGPROBS_CHUNK)
        targets = to_device(self.targets[part], torch.int64, logits.device)
        for owner, entry in zip(self.owners[part], gather_logprobs(logits.float().log_softmax(-1), targets, self.k)):
            self.out[owner].append(entry)
