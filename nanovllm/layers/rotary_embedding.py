import math

import torch

from nanovllm.attention.metadata import DecodeRope
from nanovllm.layers.custom_op import CustomOp


def rope_parameters(hf_config) -> dict:
    """One dict for transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    ramp = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - ramp) * inv_freq / factor + ramp * inv_freq
    return torch.where(wavelen > old_len / low, inv_freq / factor,
                       torch.where(wavelen < old_len / high, inv_freq, blended))


def compute_inv_freq(head_dim: int, p: dict, freq_factors=None) -> torch.Tensor:
    base = p["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = p["rope_type"]
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, p)
    elif kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")
    if freq_factors is not None:  # GGUF stores llama3 scaling as per-frequency divisors
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(CustomOp):
    """Neox-style rotary embedding (rotate halves) with a cos/sin table over all positions. Qwen3's per-head
    q/k RMSNorms, when given, run first (fused into the same kernel on the Triton path)."""

    def __init__(self, head_dim: int, max_position: int, params: dict, freq_factors=None):
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, params, freq_factors)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._tables = {}  # dtype -> (cos, sin) cast once for the Triton kernel

    def tables(self, dtype: torch.dtype):
        """The cos/sin tables cast to `dtype`, made once (the ModelRunner asks before any graph capture)."""
        if dtype not in self._tables:
            self._tables[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._tables[dtype]

    def decode_rope(self, dtype: torch.dtype, q_norm=None, k_norm=None) -> DecodeRope:
        """What an attention kernel needs to apply this rotary (after the q/k norms) itself."""
        cos, sin = self.tables(dtype)
        if q_norm is None:
            return DecodeRope(cos, sin, None, None, 0.0)
        return DecodeRope(cos, sin, q_norm.weight, k_norm.weight, q_norm.eps)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_triton(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm=None, k_norm=None):
        """In place on q and k."""
        from nanovllm.kernels.rotary import rotary_

        cos, sin = self.tables(q.dtype)
        if q_norm is None:
            return rotary_(positions, q, k, cos, sin)
        return rotary_(positions, q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
