import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod


class VocabEmbedding(CustomOp):
    """Token ids -> embeddings. With a GGUF quant_config the table stays in the file's blocks (`qweight`, and
    `weight` is None once loaded) and a step dequantizes only its tokens' rows. With tensor parallelism each rank
    holds a slice of the vocabulary, embeds the ids in it (zeros elsewhere) and the ranks' rows sum."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_config=None):
        super().__init__()
        self.quant_config = quant_config
        self.qweight = None
        self.num_rows = rows = vocab_size // tp_size()
        self.vocab_start = tp_rank() * rows
        device = "meta" if quant_config is not None else None  # the loaded tensor decides what is allocated
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, device=device), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        if tp_size() > 1:
            loaded = loaded.narrow(0, self.vocab_start, param.shape[0])
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        if self.quant_config is None:
            param.data.copy_(loaded)
        elif isinstance(loaded, torch.Tensor):  # stored dense in the file
            self.weight = nn.Parameter(loaded.to(self.quant_config.device, self.quant_config.dtype),
                                       requires_grad=False)
        else:
            self.qweight, self.weight = loaded.to(self.quant_config.device), None

    def forward_native(self, token_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() > 1:
            local = token_ids - self.vocab_start
            outside = (local < 0) | (local >= self.num_rows)
            return all_reduce(self._rows(local.masked_fill(outside, 0)).masked_fill(outside[..., None], 0))
        return self._rows(token_ids)

    def _rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            rows = self.qweight.map_rows(lambda field: field.index_select(0, token_ids.reshape(-1)))
            return rows.dequantize().to(self.quant_config.dtype).view(*token_ids.shape, self.qweight.shape[1])
        table = F.embedding(token_ids, self.weight)
        return table if self.quant_config is None else table.to(self.quant_config.dtype)

    def share_table(self, table: torch.Tensor):
        """After loading: the tied LM head's dense table (its quantized method made it) serves the lookups too, in
        place of the file's blocks."""
        self.weight, self.qweight = nn.Parameter(table, requires_grad=False), None

    def forward_triton(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None or tp_size() > 1:
            return self.forward_native(token_ids)
        from nanovllm.kernels.embedding import embedding

        return embedding(token_ids.reshape(-1), self.weight).view(*token_ids.shape, self.weight.shape[1])


class LMHead(nn.Module):
    """Hidden states -> logits in the model's dtype (the sampler reads them so); shares the embedding's weight
    when tied. A linear layer of one shard, so that a quantized linear method serves it as it serves the others.
    With tensor parallelism each rank computes its vocabulary slice's logits, gathered side by side."""
    tp_dim = 0

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 linear_method: LinearMethod | None = None):
        super().__init__()
        self.input_size, self.output_size = hidden_size, vocab_size // tp_size()
        self.output_shards = {None: (0, self.output_size)}
        self.linear_method = linear_method or UnquantizedLinearMethod()
        if tied_to is not None:
            self.weight, self.bias = tied_to.weight, None
        else:
            self.linear_method.create_weights(self, bias=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None):
        self.linear_method.load_weight(self, param, loaded, shard_id)

    def tie(self, embedding: VocabEmbedding):
        """After loading: a quantized method takes the embedding's table as it was loaded."""
        if not isinstance(self.linear_method, UnquantizedLinearMethod):
            self.tied_embedding = embedding
            self.linear_method.create_weights(self, bias=False)
            loaded = embedding.qweight if embedding.qweight is not None else embedding.weight
            self.linear_method.load_weight(self, self.weight, loaded)

    rank_part = LinearBase.rank_part

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if tp_size() > 1:
            return all_gather_last_dim(self.linear_method.apply(self, hidden), out)
        return self.linear_method.apply(self, hidden, out)
