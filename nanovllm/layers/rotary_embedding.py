import math

import torch

from nanovllm.kernels.attention_inputs import DecodeRope
from nanovllm.layers.custom_op import CustomOp
from nanovllm.rope_scaling import original_max_positions, scaled_max_positions


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    ramp = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - ramp) * inv_freq / factor + ramp * inv_freq
    return torch.where(wavelen > old_len / low, inv_freq / factor,
                       torch.where(wavelen < old_len / high, inv_freq, blended))


def _yarn_inv_freq(head_dim: int, p: dict, max_position: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided
    by `factor`), those that turn more than beta_fast times are kept, with a linear ramp between (HF's formula)."""
    base, factor = p["rope_theta"], p["factor"]
    old_len = original_max_positions(p, max_position)

    def dim_of(rotations: float) -> float:  # the frequency index that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(p.get("beta_fast") or 32), dim_of(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # 1 where the frequency is extrapolated (kept), 0 where interpolated
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def attention_factor(p: dict) -> float:
    """YaRN's scale of cos and sin (the attention logits' temperature); 1 for every other type."""
    if p["rope_type"] != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = p["factor"]
    if p.get("mscale") and p.get("mscale_all_dim"):
        return float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
    return mscale(factor)


def compute_inv_freq(head_dim: int, p: dict, max_position: int, freq_factors=None) -> torch.Tensor:
    """max_position: the config's max_position_embeddings (yarn's default original context; dynamic NTK's base)."""
    base = p["rope_theta"]
    kind = p["rope_type"]
    if kind == "dynamic":  # vLLM's static NTK: the base stretched once for the whole scaled context
        factor = p["factor"]
        base = base * (factor * scaled_max_positions(p, max_position) / max_position - (factor - 1)) ** (
            head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, p)
    elif kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, p, max_position)
    elif kind not in ("default", "dynamic"):
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, dynamic, yarn, llama3")
    if freq_factors is not None:  # GGUF stores llama3 scaling as per-frequency divisors
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(CustomOp):
    """Neox-style rotary embedding (rotate halves) with a cos/sin table over all positions (rope scaling: default,
    linear, dynamic NTK, yarn, llama3). Qwen3's per-head
    q/k RMSNorms, when given, run first (fused into the same kernel on the Triton path)."""

    def __init__(self, head_dim: int, max_position: int, params: dict, freq_factors=None):
        """max_position: the config's max_position_embeddings; the tables cover what the scaling reaches."""
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, params, max_position, freq_factors)
        positions = torch.arange(scaled_max_positions(params, max_position), dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(params)  # yarn scales cos and sin alike, as HF's rotary does
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
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
