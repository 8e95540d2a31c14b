"""Qwen3-Next and Qwen3.5 (text): hybrids of linear and full attention. Each layer's token mixer is either a Gated
DeltaNet (config layer_types "linear_attention": a causal conv1d over the projected q, k, v, then the gated delta
rule, its output normed and gated by z) or full attention with an output gate (q_proj gives each head's query and
gate; q/k norms; rotary on the first partial_rotary_factor of each head). Their MLPs are mixtures of experts with a
shared expert, as Qwen2-MoE's (dense in Qwen3.5's dense models). Their RMSNorms scale by 1 + weight (stored
zero-centered): they load as our RMSNorm with weight + 1. Qwen3.5 projects q, k, v, z, b and a separately where
Qwen3-Next interleaves them by key head; its multimodal rotary (mrope) is plain rotary for text, whose three
position ids are equal.

A linear-attention layer keeps a fixed-size state a sequence (a StateSpec): its conv state and its state matrix, in
the sequence's slot. Here the plain torch path: each sequence's tokens in turn, the chunked form for prompts and the
recurrent form for decode (layers/linear_attention.py)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention import AttentionMetadata
from nanovllm.distributed.parallel_state import tp_size
from nanovllm.kvcache.spec import StateSpec
from nanovllm.layers.attention import Attention
from nanovllm.layers.custom_op import CustomOp
from nanovllm.layers.embed_head import LMHead, VocabEmbedding
from nanovllm.layers.fla_prefill import fla_ops, prefill_varlen
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnLinear, RowParallelLinear
from nanovllm.layers.linear_attention import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_step,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.logger import log_once
from nanovllm.models.llama import LlamaMLP, LlamaModel
from nanovllm.models.qwen3_moe import EXPERT_TENSOR, Qwen3MoeForCausalLM
from nanovllm.quant.gguf_linear import GGUFConfig
from nanovllm.quant.gguf_weight import GGUFWeight
from nanovllm.rope_scaling import rope_parameters


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(CustomOp):
    def __init__(self, config):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        # the checkpoint's in_proj_qkvz and in_proj_ba in one matrix: one read of x, one launch a step
        self.in_proj = MergedColumnLinear(hidden, self.in_proj_sizes())
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(self.value_dim, hidden)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, width - 1], fp32
        self.ssm_state: torch.Tensor | None = None  # [slots, value heads, head_k_dim, head_v_dim], fp32

    def in_proj_sizes(self) -> list[int]:
        return [2 * self.key_dim + 2 * self.value_dim, 2 * self.num_v_heads]

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> StateSpec:
        return StateSpec(((self.conv_dim, self.conv_width - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
                         torch.float32)

    def bind_kv_cache(self, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def project(self, x: torch.Tensor):
        """(q k v side by side [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv]) from Qwen3-Next's projections: per
        key head, its q, k, then its group of value heads' v and z; per key head, its group's b, then a."""
        qkvz, ba = self.in_proj(x).split(self.in_proj_sizes(), -1)
        tokens, group = qkvz.shape[0], self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        q, k, v, z = qkvz.view(tokens, self.num_k_heads, -1).split([dk, dk, group * dv, group * dv], -1)
        b, a = ba.view(tokens, self.num_k_heads, -1).split([group, group], -1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], -1)
        return mixed, z.reshape(tokens, self.num_v_heads, dv), b.reshape(tokens, -1), a.reshape(tokens, -1)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if x.is_cuda and not self.use_triton:
            log_once("linear attention runs the plain torch gated delta rule (the torch attention backend)")
        mixed, z, b, a = self.project(x)
        out = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        decodes = meta.num_decodes if meta.state_slot_ids is not None else 0
        if decodes:  # one token each, first in the step: one batched step on their slots
            out[:decodes] = self._decode(mixed[:decodes], b[:decodes], a[:decodes], meta)
        if decodes < meta.num_seqs:
            rows = slice(meta.query_start_loc_cpu[decodes], None)
            prefill = self._prefill_fla if self.use_triton and fla_ops() else self._prefill_native
            out[rows] = prefill(mixed[rows], *self._gates(b[rows], a[rows]), meta, decodes)
        return self.out_proj(self._gated_norm(out, z))

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log decay g fp32, beta), as HF computes them."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _decode(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = mixed.shape[0]
        slots, seq_lens = meta.state_slot_ids[:n], meta.seq_lens[:n]
        if self.use_triton:
            from nanovllm.kernels.gated_delta_decode import conv1d_step, gated_delta_rule_step_slots

            mixed = conv1d_step(mixed, self.conv1d.weight[:, 0], self.conv_state, slots, seq_lens)
            return gated_delta_rule_step_slots(mixed, a, b, self.A_log, self.dt_bias, self.ssm_state, slots, seq_lens,
                                               self.num_k_heads)
        g, beta = self._gates(b, a)
        slots, kept = slots.long(), (seq_lens > 1).float()[:, None, None]  # a 1-token prompt starts from zeros
        mixed, self.conv_state[slots] = causal_conv1d_step(mixed, self.conv1d.weight[:, 0], None,
                                                           self.conv_state[slots] * kept)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = (_l2norm(t.reshape(n, self.num_k_heads, self.head_k_dim)) for t in (q, k))
        out, self.ssm_state[slots] = gated_delta_rule_step(q, k, v.reshape(n, self.num_v_heads, self.head_v_dim), g,
                                                           beta, self.ssm_state[slots] * kept[..., None])
        return out

    def _prefill_fla(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                     first: int) -> torch.Tensor:
        """The step's prompts (its sequences from `first` on) in one varlen launch each of fla-core's kernels."""
        starts = meta.query_start_loc_cpu[first:]
        cu_seqlens = [start - starts[0] for start in starts]
        conv_states = ssm_states = None
        if meta.state_slots is not None:
            slots = meta.state_slot_ids[first:].long()
            fresh = [meta.seq_lens_cpu[i] == starts[i - first + 1] - starts[i - first]
                     for i in range(first, meta.num_seqs)]
            kept = ~torch.tensor(fresh, device=mixed.device)[:, None, None]
            conv_states, ssm_states = self.conv_state[slots] * kept, self.ssm_state[slots] * kept[..., None]
        out, after = prefill_varlen(mixed, g, beta, self.conv1d.weight[:, 0], conv_states, ssm_states, cu_seqlens,
                                    self.num_k_heads, self.head_k_dim, self.num_v_heads)
        if after is not None:
            self.conv_state[slots], self.ssm_state[slots] = (t.to(self.conv_state.dtype) for t in after)
        return out

    def _prefill_native(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                        first: int) -> torch.Tensor:
        """The step's prompts one at a time in plain torch."""
        starts, outs = meta.query_start_loc_cpu, []
        for i in range(first, meta.num_seqs):
            rows = slice(starts[i] - starts[first], starts[i + 1] - starts[first])
            outs.append(self._sequence(mixed[rows], g[rows], beta[rows], meta.seq_lens_cpu[i],
                                       meta.state_slots[i] if meta.state_slots else None))
        return torch.cat(outs)

    def _sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seq_len: int,
                  slot: int | None) -> torch.Tensor:
        """One sequence's new tokens (its context seq_len after them), from and into its state slot (None: a
        profiling step, from zeros, kept nowhere)."""
        fresh = seq_len == mixed.shape[0]
        conv_state = None if fresh or slot is None else self.conv_state[slot]
        ssm_state = None if fresh or slot is None else self.ssm_state[slot]
        mixed, conv_after = causal_conv1d(mixed, self.conv1d.weight[:, 0], None, conv_state)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        tokens = mixed.shape[0]
        q, k = (_l2norm(t.reshape(tokens, self.num_k_heads, self.head_k_dim)) for t in (q, k))
        v = v.reshape(tokens, self.num_v_heads, self.head_v_dim)
        rule = gated_delta_rule_recurrent if tokens == 1 else gated_delta_rule_chunked
        out, ssm_after = rule(q, k, v, g, beta, ssm_state)
        if slot is not None:
            self.conv_state[slot] = conv_after
            self.ssm_state[slot] = ssm_after
        return out

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """HF's RMSNormGated: each head's output normed, scaled, times silu(z) -> [T, H * dv]."""
        if self.use_triton:
            from nanovllm.kernels.gated_rms_norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.norm.weight, self.eps)
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.norm.weight * normed * F.silu(gate.float())).to(x.dtype).flatten(1)


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's: q, k, v in one projection, z, b and a each in their own (in_proj's four pieces)."""

    def in_proj_sizes(self) -> list[int]:
        return [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]

    def project(self, x: torch.Tensor):
        mixed, z, b, a = self.in_proj(x).split(self.in_proj_sizes(), -1)
        return mixed, z.view(x.shape[0], self.num_v_heads, self.head_v_dim), b, a


class Qwen3NextAttention(nn.Module):
    """Full attention whose output each head gates with sigmoid(gate), the gate coming from q_proj beside the query."""

    def __init__(self, config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q, kv, bias = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, config.attention_bias
        self.qkv_proj = MergedColumnLinear(config.hidden_size, [2 * q, kv, kv], bias)
        self.o_proj = RowParallelLinear(q, config.hidden_size, bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        params = rope_parameters(config)
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))  # transformers 5, 4
        self.rotary_dim = int(self.head_dim * partial)
        self.rotary = RotaryEmbedding(self.rotary_dim, config.max_position_embeddings, params)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split([2 * self.num_heads * self.head_dim,
                                               self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        rd = self.rotary_dim
        q_rot, k_rot = self.rotary.forward_native(positions, q[..., :rd], k[..., :rd])
        q, k = torch.cat([q_rot, q[..., rd:]], -1), torch.cat([k_rot, k[..., rd:]], -1)
        out = self.attn(q, k, v.reshape(tokens, self.num_kv_heads, self.head_dim).contiguous(), meta)
        return self.o_proj(out.flatten(1) * gate.reshape(tokens, -1).sigmoid())


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, mlp: nn.Module, linear_attention=GatedDeltaNet):
        super().__init__()
        if layer_type == "linear_attention":
            self.linear_attn = linear_attention(config)
        elif layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(config)
        else:
            raise ValueError(f"unsupported layer type {layer_type!r}: linear_attention or full_attention")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "linear_attn"):
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(positions, hidden, meta)
        return self.mlp.after_norm(self.post_attention_layernorm, hidden, residual)


class Qwen3NextModel(LlamaModel):
    """Llama's embedding, layer loop and final norm over hybrid layers."""

    def __init__(self, config, make_mlp, linear_attention):
        nn.Module.__init__(self)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, kind, make_mlp(i), linear_attention)
                                    for i, kind in enumerate(layer_types(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def layer_types(config) -> list[str]:
    """Each layer's token mixer: the config's layer_types, else every full_attention_interval-th layer full."""
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        interval = config.full_attention_interval
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    return list(kinds)


class Qwen3NextForCausalLM(Qwen3MoeForCausalLM):
    supports_prefill_graphs = False  # prompts' linear attention reads host values (fla-core, the sequences' lengths)
    experts_only_quantized = True  # the linear attention takes no quantized weights: a GGUF file's experts alone stay
    linear_attention = GatedDeltaNet
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                      "in_proj_qkvz": ("in_proj", 0), "in_proj_ba": ("in_proj", 1),  # Qwen3-Next's linear attention
                      "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
                      "in_proj_a": ("in_proj", 3)}  # Qwen3.5's

    def __init__(self, config, quant_config=None):
        nn.Module.__init__(self)
        name = config.architectures[0]
        if quant_config is not None and (not isinstance(quant_config, GGUFConfig) or quant_config.int4):
            raise NotImplementedError(f"quantization at load is not supported yet for {name}: pass quantization=None")
        if tp_size() > 1:
            raise NotImplementedError(f"tensor_parallel_size > 1 is not supported yet for {name}")
        if quant_config is not None:
            log_once(f"{name}: a GGUF file's routed experts stay in their blocks; its other weights are dequantized at "
                     "load")
        self.model = Qwen3NextModel(config, lambda i: self.make_mlp(config, i, quant_config) or LlamaMLP(config),
                                    self.linear_attention)
        self.tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, self.model.embed_tokens if self.tied else None)

    def load_weights(self, weights):
        """The zero-centered RMSNorms (not the gated one inside the linear attention) load as 1 + weight; a GGUF
        file's blocks are dequantized but the routed experts'."""
        super().load_weights((name, self._dense(name, tensor)) for name, tensor in weights)

    @staticmethod
    def _dense(name: str, tensor):
        if isinstance(tensor, GGUFWeight) and not EXPERT_TENSOR.match(name):
            tensor = tensor.dequantize()
        return tensor + 1 if name.endswith("norm.weight") and ".linear_attn." not in name else tensor


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5, dense (Qwen3_5ForCausalLM: every MLP a Llama MLP) or with experts (Qwen3_5MoeForCausalLM); from a
    vision-language checkpoint, its language model (model.language_model.*; the vision tower and the multi-token
    prediction head are not loaded)."""

    linear_attention = Qwen35GatedDeltaNet

    def load_weights(self, weights):
        super().load_weights((name.replace("model.language_model.", "model.", 1), tensor) for name, tensor in weights
                             if not name.startswith(("model.visual.", "mtp.")))
