"""Llama-family decoder (Llama 2/3, SmolLM2); Qwen2 and Qwen3 are the same network with two switches:
a bias on q/k/v (Qwen2) and an RMSNorm on each head of q and k before rotary (Qwen3)."""
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.attention import AttentionMetadata
from nanovllm.distributed.parallel_state import local_part, tp_size
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import LMHead, VocabEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnLinear, QKVLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.rope_scaling import rope_parameters


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, quant_config=None):
        super().__init__()
        self.num_heads = local_part(config.num_attention_heads, "attention heads")  # this rank's
        self.num_kv_heads = local_part(config.num_key_value_heads, "KV heads")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias,
                                   linear_method=_linear_method(quant_config))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, o_bias,
                                       linear_method=_linear_method(quant_config))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv: qkv_proj's output (the decoder layer runs it with the norm before it)."""
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.attn.rotates_in_kernel(meta):  # the attention backend norms and rotates q and k itself
            out = self.attn(q, k, v, meta, self.rotary.decode_rope(q.dtype, self.q_norm, self.k_norm))
        else:
            q, k = self.rotary(positions, q, k, self.q_norm, self.k_norm)
            out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config, quant_config=None, intermediate_size: int | None = None):
        """intermediate_size: where not the config's (a mixture of experts' shared expert)."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [inter] * 2, bias,
                                               linear_method=_linear_method(quant_config))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, linear_method=_linear_method(quant_config))
        self.act = SiluAndMul()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up), in one kernel where down_proj's method has one."""
        fused = self.down_proj.linear_method.apply_silu_and_mul(self.down_proj, gate_up)
        return self.down_proj.reduce(fused) if fused is not None else self.down_proj(self.act(gate_up))

    def after_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(norm(x + residual)), x + residual): where gate_up_proj's method can, one kernel for the norm,
        gate_up_proj and SiLU-and-mul, then down_proj alone; else the norm in front of gate_up_proj, SiLU-and-mul
        in front of down_proj, where their methods can."""
        fused = self.gate_up_proj.linear_method.apply_add_rms_norm(self.gate_up_proj, x, residual, norm,
                                                                   silu_and_mul=True)
        if fused is not None:
            activated, residual = fused
            return self.down_proj(activated), residual
        gate_up, residual = _norm_then_project(norm, self.gate_up_proj, x, residual)
        return self.down(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, quant_config=None,
                 mlp: nn.Module | None = None):
        """mlp: the layer's MLP where the model has another kind (a mixture of experts), else LlamaMLP."""
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qkv_bias, o_bias, qk_norm, quant_config)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, quant_config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        qkv, residual = _norm_then_project(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        hidden = self.self_attn(positions, qkv, meta)
        return self.mlp.after_norm(self.post_attention_layernorm, hidden, residual)


def _norm_then_project(norm: RMSNorm, proj, x: torch.Tensor, residual: torch.Tensor | None):
    """(proj(norm(x + residual)), x + residual); without a residual (the first layer), x is the residual. One
    kernel where proj's linear method has one, else the norm's kernel, then proj's."""
    fused = proj.linear_method.apply_add_rms_norm(proj, x, residual, norm)
    if fused is not None:
        return fused
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm(x, residual)
    return proj(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, quant_config=None, make_mlp=None):
        """make_mlp(layer index) -> that layer's MLP, or None for LlamaMLP."""
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config),
                                 getattr(config, "rope_freq_factors", None))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, _embedding_config(quant_config))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, qkv_bias, o_bias, qk_norm, quant_config,
                                                      make_mlp(i) if make_mlp is not None else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta, inputs_embeds=None):
        """inputs_embeds: the input ids' embeddings where the caller gathered them (a decode graph's first kernel)."""
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qkv_bias = False  # True: q/k/v always carry a bias, o_proj never (Qwen2)
    qk_norm = False
    special_params: tuple[str, ...] = ()  # name pieces of the parameters that load_special loads and checks itself
    supports_cuda_graphs = True
    supports_prefill_graphs = True  # with supports_cuda_graphs: steps with prefills may replay graphs too
    # HF tensor name piece -> (our parameter name piece, shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, quant_config=None):
        """quant_config: quantized projections (quant.base_config.QuantizationConfig), else None: dense."""
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        attention_bias = getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, self.qkv_bias or attention_bias, attention_bias and not self.qkv_bias,
                                self.qk_norm, quant_config, lambda i: self.make_mlp(config, i, quant_config))
        tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, self.model.embed_tokens if tied else None,
                              _linear_method(_embedding_config(quant_config)))
        self.tied = tied

    def make_mlp(self, config, layer_index: int, quant_config) -> nn.Module | None:
        """A layer's MLP where it is not LlamaMLP (None)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, inputs_embeds)

    def embedding_table(self) -> torch.Tensor | None:
        """The [vocab, hidden] table that a caller may gather input embeddings from itself (forward's inputs_embeds),
        or None where the model's embedding runs its plain torch path (CPU, the torch backend)."""
        embed = self.model.embed_tokens
        usable = embed.use_triton and embed.weight is not None and embed.weight.is_contiguous() and tp_size() == 1
        return embed.weight if usable else None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: [rows, vocab] to write the logits into (a CUDA graph's static output)."""
        return self.lm_head(hidden, out)

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        """Load a tensor that the generic mapping below does not place (a model's experts); False: not one."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        missing = {name for name in params if not any(piece in name for piece in self.special_params)}
        for name, tensor in weights:
            if self.tied and name == "lm_head.weight":
                continue
            if "rotary_emb" in name or self.load_special(name, tensor):
                continue
            shard_id = None
            for hf_piece, (piece, sid) in self.stacked_params.items():
                if f".{hf_piece}." in name:
                    name, shard_id = name.replace(hf_piece, piece), sid
                    break
            if name not in params:
                raise ValueError(f"the checkpoint has a tensor {name!r} that this {type(self).__name__} lacks")
            param = params[name]
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            loader = getattr(owner, "weight_loader", _copy_loader)
            loader(param, tensor, shard_id)
            missing.discard(name)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)


def _linear_method(quant_config):
    return quant_config.linear_method() if quant_config is not None else None


def _embedding_config(quant_config):
    """The embedding and LM head follow a GGUF file's types; weights quantized at load leave them dense."""
    return quant_config if quant_config is not None and quant_config.quantize_embeddings else None


def _copy_loader(param, tensor, shard_id=None):
    if param.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(tensor)
