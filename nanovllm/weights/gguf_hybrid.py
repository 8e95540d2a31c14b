"""Qwen3-Next and Qwen3.5 GGUF files (general.architecture "qwen3next", "qwen35", "qwen35moe") back to HF names,
undoing what llama.cpp's converter did to them. Qwen3-Next's linear attention has its q, k, v de-interleaved into
one attn_qkv and z into attn_gate, which is Qwen3.5's layout: all three load as Qwen3_5ForCausalLM. In all of them
ssm_a holds -exp(A_log), ssm_dt.bias is dt_bias, the conv1d weight lost its middle dimension, and every
zero-centered RMSNorm (not the gated one, ssm_norm) was stored as 1 + weight. Qwen3-Next keeps b and a interleaved
by key head in ssm_ba; Qwen3.5's ssm_beta / ssm_alpha, and every other value-head dimension of its linear attention,
have their value heads reordered from grouped by key head to tiled (for ggml's broadcast)."""
import torch

from nanovllm.quant.gguf_weight import GGUFWeight

LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
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
        layer_types=layer_types, partial_rotary_factor=key("rope.dimension_count") / key("attention.key_length"),
        attention_bias=False, intermediate_size=key("feed_forward_length") or key("expert_feed_forward_length"),
        **({"shared_expert_intermediate_size": key("expert_shared_feed_forward_length")} if key("expert_count")
           else {"num_experts": 0}))  # Qwen3.5's dense models: no experts (and no dense MLP in its MoE ones)


def hf_tensors(name: str, tensor, hf_config, tiled: bool) -> list[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF name, tensor) of one GGUF tensor already given its HF-like name. tiled: a Qwen3.5 file, whose linear
    attention's value heads are in tiled order."""
    if tiled and ".linear_attn." in name:
        tensor = _grouped(name, tensor, hf_config)
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


def _grouped(name: str, tensor, c):
    """A Qwen3.5 tensor's value heads back from tiled ([k0, k1, ..., k0, k1, ...]) to grouped by key head."""
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    if hk == hv:
        return tensor
    if isinstance(tensor, GGUFWeight):
        tensor = tensor.dequantize()  # the linear attention takes dense weights (models/qwen3_next.py)
    qk = 2 * hk * c.linear_key_head_dim
    dv = c.linear_value_head_dim
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # only the value rows / channels, after q and k
        return torch.cat([tensor[:qk], _untile(tensor[qk:], 0, hk, hv // hk, dv)])
    if name.endswith(".in_proj_z.weight"):
        return _untile(tensor, 0, hk, hv // hk, dv)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return _untile(tensor, 0, hk, hv // hk, 1)
    if name.endswith(".out_proj.weight"):
        return _untile(tensor, 1, hk, hv // hk, dv)
    return tensor


def _untile(t: torch.Tensor, dim: int, num_k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, num_k_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _rows(tensor, index: torch.Tensor):
    if isinstance(tensor, GGUFWeight):
        return tensor.map_rows(lambda field: field[index.to(field.device)].contiguous())
    return tensor[index]
