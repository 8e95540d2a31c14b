"""One step as every tensor-parallel rank runs it (ModelRunner.execute). Rank 0 builds it from the scheduled
sequences; the other ranks receive the same command (distributed/workers.py: its device tensors by broadcast, the
rest pickled) and run it with the same collectives, in the same order. Only rank 0 samples and reads results."""
from dataclasses import dataclass, field

import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.engine.sequence import Sequence
from nanovllm.kvcache.block_copy import BlockCopy
from nanovllm.layers.logprobs import TokenLogprobs

EAGER, LAYER_MAJOR, DECODE_GRAPH, PREFILL_GRAPH, STEADY = "eager", "layer_major", "decode_graph", "prefill_graph", "steady"


@dataclass
class StepCommand:
    path: str  # how the forward runs: one of the five names above
    block_copies: list[BlockCopy] = field(default_factory=list)  # before the forward (swaps, offloads, prefix loads)
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: AttentionMetadata | None = None
    layer_major: tuple[int, list[int], list[int]] | None = None  # (computed tokens, host blocks, device blocks)
    prompt_rows: list[torch.Tensor] = field(default_factory=list)  # rows of hidden whose logits score the prompt
    num_samples: int = 0  # rows that sample a token
    sample_rows: torch.Tensor | None = None  # their rows of hidden or of the decode graph's logits (None: every row)
    graph_sampling: tuple[torch.Tensor, ...] | None = None  # (temperature, seeds, steps): the sampling graph draws
    advance_steps: torch.Tensor | None = None  # rank 0's sampled tokens become the decode graph's next inputs
    steady: tuple[int, int] | None = None  # (rows, longest context): the decode graph on the inputs it left
    new_blocks: tuple[torch.Tensor, ...] | None = None  # steady: (rows, columns, block ids) taken since


@dataclass
class StepHandle:
    """A step launched on the device whose sampled tokens may still be in flight."""

    seqs: list[Sequence]
    prompt_logprobs: list[list[TokenLogprobs]]
    sample_idx: list[int]  # rows of seqs that sample a token this step
    tokens: torch.Tensor | None = None  # [len(sample_idx)] on the device
    tokens_host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    raw_logprobs: torch.Tensor | None = None
    max_logprobs: int = -1


@dataclass
class RunnerOutput:
    sampled: list[int | None]  # per scheduled seq: the new token, None while its prompt is still filling
    logprobs: list[TokenLogprobs | None]  # per scheduled seq, when it asked for logprobs
    prompt_logprobs: list[list[TokenLogprobs]]  # per scheduled seq: entries for this step's prompt positions
