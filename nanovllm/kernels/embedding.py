"""Embedding rows gathered by token id, launched under PDL like the kernels around it: in a bs=1 decode step on
the H100, torch's gather (no PDL) started ~1.6 us after the step's first kernel ended and took ~2.4 us. Token ids
are checked against the vocabulary before they reach the engine. Reference: F.embedding
(layers.embed_head.VocabEmbedding.forward_native)."""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import pdl_launch, wait_then_release


@triton.jit
def embed_row(ids_ptr, weight_ptr, out_ptr, row, cols, hidden, width):
    """Columns `cols` (those < width) of out's row `row`: the weight row of token ids[row]."""
    mask = cols < width
    token = tl.load(ids_ptr + row).to(tl.int64)
    tl.store(out_ptr + row.to(tl.int64) * hidden + cols, tl.load(weight_ptr + token * hidden + cols, mask=mask),
             mask=mask)


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, hidden, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    embed_row(ids_ptr, weight_ptr, out_ptr, tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), hidden,
              hidden)


def embedding(token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """token_ids: [N] (contiguous), weight: [vocab, hidden] contiguous -> [N, hidden]."""
    assert token_ids.dim() == 1 and weight.is_contiguous()
    hidden = weight.shape[1]
    out = torch.empty(token_ids.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    block = min(triton.next_power_of_2(hidden), 2048)
    _embedding_kernel[(token_ids.shape[0], triton.cdiv(hidden, block))](
        token_ids.contiguous(), weight, out, hidden, BLOCK=block, num_warps=4, **pdl_launch(weight.device))
    return out
