"""Qwen3-Next GGUF files (general.architecture "qwen3next") back to HF names, undoing what llama.cpp's converter did
to them: its linear attention's q, k, v are de-interleaved into one attn_qkv and z into attn_gate (the layout of
Qwen3.5's separate projections, so these files load as Qwen3_5ForCausalLM's layers), ssm_a holds -exp(A_log),
ssm_dt.bias is dt_bias, the conv1d weight lost its middle dimension, and every zero-centered RMSNorm (not the gated
one, ssm_norm) was stored as 1 + weight. b and a stay interleaved by key head in ssm_ba."""
import torch

from nanovllm.quant.gguf_weight import GGUFWeight

LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
PARAMETERS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}  # tensors that are one parameter


def config_kwargs(key, num_layers: int) -> dict:
    """Qwen3NextConfig's fields from the file's qwen3next.* metadata (key(name) reads one)."""
    value_heads = key("ssm.time_step_rank")
    recurrent = key("attention.recurrent_layers")
    interval = key("full_attention_interval", 4)
    layer_types = ["linear_attention" if r else "full_attention" for r in recurrent] if recurrent else \
        ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    return dict(
        architectures=["Qwen3_5MoeForCausalLM"], linear_conv_kernel_dim=key("ssm.conv_kernel"),
        linear_key_head_dim=key("ssm.state_size"), linear_num_key_heads=key("ssm.group_count"),
        linear_num_value_heads=value_heads, linear_value_head_dim=key("ssm.inner_size") // value_heads,
        layer_types=layer_types, shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
        partial_rotary_factor=key("rope.dimension_count") / key("attention.key_length"), attention_bias=False)


def hf_tensors(name: str, tensor, hf_config) -> list[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF name, tensor) of one GGUF tensor already given its HF-like name."""
    if name.endswith(".A_log"):
        return [(name, (-tensor).log())]
    if name.endswith(".linear_attn.conv1d.weight"):
        return [(name, tensor.unsqueeze(1))]
    if name.endswith("norm.weight") and ".linear_attn." not in name:
        return [(name, tensor - 1)]  # the model folds the 1 in again, as for an HF checkpoint
    if name.endswith(".in_proj_ba.weight"):
        group = hf_config.linear_num_value_heads // hf_config.linear_num_key_heads
        rows = torch.arange(tensor.shape[0]).view(hf_config.linear_num_key_heads, 2, group)
        prefix = name.removesuffix("in_proj_ba.weight")
        return [(prefix + f"in_proj_{part}.weight", _rows(tensor, rows[:, i].flatten())) for i, part in
                enumerate("ba")]
    return [(name, tensor)]


def _rows(tensor, index: torch.Tensor):
    if isinstance(tensor, GGUFWeight):
        return tensor.map_rows(lambda field: field[index.to(field.device)].contiguous())
    return tensor[index]
