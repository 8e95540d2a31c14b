"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), and Qwen2-MoE beside it: Qwen3's attention (Qwen2's), and in the
sparse layers a mixture of experts in place of the MLP: a linear router over num_experts, softmax, the top
num_experts_per_tok (renormalized where norm_topk_prob), each a SiLU-gated MLP of moe_intermediate_size (Qwen2-MoE:
and a shared expert). A layer is sparse unless it is in mlp_only_layers or (its index + 1) is not a multiple of
decoder_sparse_step; dense layers keep the Llama MLP."""
import contextlib
import re

import torch
from torch import nn

from nanovllm.distributed.parallel_state import tp_size
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.llama import LlamaMLP, _linear_method
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.quant.gguf_experts import GGUFExperts
from nanovllm.quant.gguf_linear import GGUFConfig

# model.layers.L.mlp.experts.E.gate_proj.weight (a tensor an expert), or model.layers.L.mlp.experts.gate_up_proj
EXPERT_TENSOR = re.compile(r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?:(?P<expert>\d+)\.)?(?P<proj>\w+?)"
                           r"(?:\.weight)?$")


class Qwen3MoeSparseBlock(nn.Module):
    """The routed experts, and where the config has shared_expert_intermediate_size (Qwen2-MoE, Qwen3-Next,
    Qwen3.5), a shared expert every token runs, scaled by a sigmoid gate."""

    def __init__(self, config, quant_config=None, experts_only: bool = False):
        """quant_config: a GGUF file's (GGUFConfig): its experts stay in their blocks (quant/gguf_experts.py; on CUDA
        dequantized once loaded unless all are Q4_K); the router and shared expert follow it, unless experts_only
        (they are dense)."""
        super().__init__()
        dense_config = None if experts_only else quant_config
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, linear_method=_linear_method(dense_config))
        kept = quant_config is not None
        with torch.device("meta") if kept else contextlib.nullcontext():  # kept quantized: no dense experts at all
            self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                    config.moe_intermediate_size, getattr(config, "norm_topk_prob", True))  # 3.5: always
        if kept:
            self.experts.quantized = GGUFExperts(config.num_experts, self.experts.w13.dtype,
                                                 quant_config.weights_device, quant_config.device)
            self.experts.w13 = self.experts.w2 = None
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = LlamaMLP(config, dense_config, intermediate_size=shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        self.loaded: set[tuple[int | None, str]] = set()  # (expert or None for all, projection) of the checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out += self.shared_expert_gate(x).sigmoid() * self.shared_expert(x)
        return out

    def after_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm(x, residual)
        return self(x), residual

    def missing_experts(self) -> list[str]:
        """The expert tensors the checkpoint did not give (a per-expert tensor, or the stacked one that holds it)."""
        stacked = {proj for expert, proj in self.loaded if expert is None}
        held_in = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
        return [f"expert {e} {proj}" for e in range(self.experts.num_experts) for proj, whole in held_in.items()
                if (e, proj) not in self.loaded and not {proj, whole} & stacked]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    special_params = (".experts.",)
    experts_only_quantized = False  # a GGUF file's router and shared expert dense too (only the experts in blocks)

    def __init__(self, config, quant_config=None):
        if quant_config is not None and not isinstance(quant_config, GGUFConfig) or getattr(quant_config, "int4", False):
            raise NotImplementedError(f"quantization at load is not supported yet for {config.architectures[0]}: load "
                                      "its 16-bit checkpoint with quantization=None, or a GGUF file")
        if tp_size() > 1:
            raise NotImplementedError("tensor_parallel_size > 1 is not supported yet for mixture-of-experts models")
        super().__init__(config, quant_config)

    def make_mlp(self, config, layer_index: int, quant_config) -> nn.Module | None:
        sparse = layer_index not in (getattr(config, "mlp_only_layers", None) or []) \
            and getattr(config, "num_experts", 0) > 0 \
            and (layer_index + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        return Qwen3MoeSparseBlock(config, quant_config, self.experts_only_quantized) if sparse else None

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        match = EXPERT_TENSOR.match(name)
        if match is None:
            return False
        layer, expert = int(match["layer"]), match["expert"] and int(match["expert"])
        block = self.model.layers[layer].mlp if layer < len(self.model.layers) else None
        if not isinstance(block, Qwen3MoeSparseBlock):
            raise ValueError(f"the checkpoint has an expert tensor {name!r} for layer {layer}, which has no experts "
                             "in this config (mlp_only_layers / decoder_sparse_step)")
        if expert is not None and expert >= block.experts.num_experts:
            raise ValueError(f"the checkpoint has {name!r}, past the config's num_experts={block.experts.num_experts}")
        if block.experts.quantized is not None:
            block.experts.quantized.load(match["proj"], tensor)
        else:
            block.experts.load_expert(match["proj"], tensor, expert)
        block.loaded.add((expert, match["proj"]))
        return True

    def load_weights(self, weights):
        super().load_weights(weights)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, Qwen3MoeSparseBlock) and (missing := layer.mlp.missing_experts()):
                raise ValueError(f"the checkpoint lacks {len(missing)} expert tensors of layer {i}, e.g. {missing[:3]}")
            if isinstance(layer.mlp, Qwen3MoeSparseBlock) and layer.mlp.experts.quantized is not None:
                layer.mlp.experts.settle_quantized()


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v bias, no q/k norm), a shared expert beside the routed ones."""

    qkv_bias = True
    qk_norm = False
