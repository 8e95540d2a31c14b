import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.linear import LinearMethod, UnquantizedLinearMethod


class VocabEmbedding(CustomOp):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward_native(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def forward_triton(self, token_ids: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels.embedding import embedding

        return embedding(token_ids.reshape(-1), self.weight).view(*token_ids.shape, self.weight.shape[1])


class LMHead(nn.Module):
    """Hidden states -> logits in the model's dtype (the sampler reads them so); shares the embedding's weight
    when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.bias = None
        self.linear_method: LinearMethod = UnquantizedLinearMethod()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear_method.apply(self, hidden, out)
