"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5) and its causal conv1d, in
plain torch: the twin that a fused kernel (fla-core on CUDA) is tested against. Per head, a state S [dk, dv] carries
the whole past; each token decays it, corrects what it predicts for the token's key towards the token's value, and
is read by the query:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T (q_t / sqrt(dk))

`recurrent` runs that token by token (decode); `chunked` runs a prompt in chunks of C tokens: inside a chunk the
corrections solve a unit lower-triangular system (u = (I + A)^-1 (beta v - beta e^G K S0), A_tj = beta_t
e^(G_t - G_j) k_t.k_j for j < t, G the chunk's cumulative decay), so a chunk is a few matmuls. Both take and return
the state in fp32, so a prompt split into chunks of steps (chunked prefill) continues exactly."""
import torch
import torch.nn.functional as F


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key heads shared by groups of value heads (GQA-like), repeated to one a value head."""
    group = num_v_heads // k.shape[1]
    return (q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)) if group > 1 else (q, k)


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, dk]; v [T, Hv, dv]; g (log decay, <= 0), beta [T, Hv]; state [Hv, dk, dv] or None (zeros).
    Returns (o [T, Hv, dv] in v's dtype, the state after the last token, fp32)."""
    num_tokens, num_heads, dv = v.shape
    q, k = _expand_heads(q, k, num_heads)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    s = torch.zeros(num_heads, k.shape[-1], dv, device=v.device) if state is None else state.float().clone()
    out = torch.empty(num_tokens, num_heads, dv, device=v.device)
    for t in range(num_tokens):
        s *= g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s += k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out.to(v.dtype), s


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor | None = None, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as gated_delta_rule_recurrent, chunk tokens at a time."""
    num_tokens, num_heads, dv = v.shape
    q, k = _expand_heads(q, k, num_heads)
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # heads first
    q = q * q.shape[-1] ** -0.5
    s = torch.zeros(num_heads, k.shape[-1], dv, device=v.device) if state is None else state.float().clone()
    out = torch.empty(num_heads, num_tokens, dv, device=v.device)
    for start in range(0, num_tokens, chunk):
        part = slice(start, min(start + chunk, num_tokens))
        qc, kc, vc, bc = q[:, part], k[:, part], v[:, part], beta[:, part]
        cum = g[:, part].cumsum(-1)  # [H, C]: decay from the chunk's start through each token
        n = cum.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # e^(G_t - G_j), j <= t
        a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        eye = torch.eye(n, device=v.device).expand(num_heads, n, n)
        rhs = torch.cat([bc[:, :, None] * vc, bc[:, :, None] * cum.exp()[:, :, None] * kc], -1)
        solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        u = solved[..., :dv] - solved[..., dv:] @ s  # the chunk's corrections given the state before it
        out[:, part] = (qc * cum.exp()[:, :, None]) @ s + ((qc @ kc.transpose(1, 2)) * decay) @ u
        s = s * cum[:, -1].exp()[:, None, None] + (kc * (cum[:, -1:] - cum).exp()[:, :, None]).transpose(1, 2) @ u
    return out.transpose(0, 1).to(v.dtype), s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution with SiLU: x [T, C], weight [C, W]; state [C, W - 1], the inputs before x
    (None: zeros). Returns (silu(conv) [T, C], the state after x: its last W - 1 inputs)."""
    width = weight.shape[1]
    past = torch.zeros(x.shape[1], width - 1, dtype=x.dtype, device=x.device) if state is None else state.to(x.dtype)
    padded = torch.cat([past, x.t()], 1)  # [C, W - 1 + T]
    y = F.conv1d(padded[None], weight[:, None, :], bias, groups=x.shape[1])[0]
    return F.silu(y).t(), padded[:, -(width - 1):] if width > 1 else padded[:, :0]


def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences at once (a decode step): q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv];
    state [B, Hv, dk, dv]. Returns (o [B, Hv, dv] in v's dtype, the states after, fp32)."""
    q, k = _expand_heads(q, k, v.shape[1])
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state.float() * g.exp()[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", s, k))
    s = s + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q * q.shape[-1] ** -0.5).to(v.dtype), s


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv1d for one token of each of B sequences: x [B, C]; state [B, C, W - 1]. Returns (silu(conv) [B, C],
    the states after)."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], -1)  # [B, C, W]
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return F.silu(y), window[:, :, 1:]
