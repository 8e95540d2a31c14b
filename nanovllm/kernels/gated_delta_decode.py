"""A decode step of the gated delta rule and its causal conv1d in Triton, on each sequence's state slot in place:
one token of B sequences, their states read and written where they live (layers/linear_attention.py's
causal_conv1d_step and gated_delta_rule_step are the twins). fla-core runs the prompts (chunked form); it has no
kernel that updates states in slots, and gathering them out and back would triple a decode step's state traffic,
which is most of what such a step reads at large batch. A sequence of context 1 (a one-token prompt) starts from
zeros; a row whose slot is < 0 (CUDA-graph padding) writes zeros and touches no state."""
import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(x_ptr, x_stride, w_ptr, state_ptr, slots_ptr, seq_lens_ptr, y_ptr, D,
                      W: tl.constexpr, BLOCK_D: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(y_ptr + row * D + d, tl.zeros([BLOCK_D], tl.float32).to(y_ptr.dtype.element_ty), mask=mask)
        return
    kept = (tl.load(seq_lens_ptr + row) > 1).to(tl.float32)
    x = tl.load(x_ptr + row * x_stride + d, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.load(w_ptr + d * W + W - 1, mask=mask, other=0.0).to(tl.float32)
    state = state_ptr + slot * D * (W - 1) + d * (W - 1)
    for j in tl.static_range(W - 1):
        past = tl.load(state + j, mask=mask, other=0.0) * kept
        y += past * tl.load(w_ptr + d * W + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:  # the window moves on by one input
            tl.store(state + j - 1, past, mask=mask)
    tl.store(state + W - 2, x.to(state_ptr.dtype.element_ty), mask=mask)
    y = y * tl.sigmoid(y)
    tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=mask)


def conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
    """silu(causal conv1d) of one token a sequence: x [B, D] (rows may be strided), weight [D, W], state [S, D, W-1]
    (updated in place at each row's slot), slots and seq_lens [B]. Returns y [B, D] in x's dtype."""
    rows, dim = x.shape
    width = weight.shape[1]
    assert width >= 2 and x.stride(1) == 1 and weight.is_contiguous() and state.is_contiguous()
    y = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    block = 256
    _conv_step_kernel[(rows, triton.cdiv(dim, block))](x, x.stride(0), weight, state, slots, seq_lens, y, dim,
                                                       W=width, BLOCK_D=block)
    return y


@triton.jit
def _gdn_step_kernel(qkv_ptr, qkv_stride, a_ptr, b_ptr, ab_stride, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr,
                     seq_lens_ptr, out_ptr, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                     DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    vv = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = kk < DK, vv < DV
    out = out_ptr + (row * HV + head) * DV + vv
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        tl.store(out, tl.zeros([BLOCK_V], tl.float32).to(out_ptr.dtype.element_ty), mask=vmask)
        return
    kept = (tl.load(seq_lens_ptr + row) > 1).to(tl.float32)
    key_head = head // (HV // HK)
    base = qkv_ptr + row * qkv_stride
    q = tl.load(base + key_head * DK + kk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(base + HK * DK + key_head * DK + kk, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * HK * DK + head * DV + vv, mask=vmask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale  # the l2 norm of q and k, as the layer's
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    a = tl.load(a_ptr + row * ab_stride + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's softplus (threshold 20)
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus)
    beta = tl.sigmoid(tl.load(b_ptr + row * ab_stride + head).to(tl.float32))
    state = state_ptr + ((slot * HV + head) * DK + kk[:, None]) * DV + vv[None, :]
    mask = kmask[:, None] & vmask[None, :]
    s = tl.load(state, mask=mask, other=0.0) * (kept * decay)
    u = beta * (v - tl.sum(s * k[:, None], 0))
    s += k[:, None] * u[None, :]
    tl.store(state, s, mask=mask)
    tl.store(out, tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty), mask=vmask)


def gated_delta_rule_step_slots(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                                dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                                seq_lens: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """One token a sequence: qkv [B, 2 Hk dk + Hv dv] (the conv's output: q, k, v side by side), a and b [B, Hv]
    (raw: the decay is -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)), state [S, Hv, dk, dv] fp32 (updated
    in place). Returns o [B, Hv, dv] in qkv's dtype."""
    rows = qkv.shape[0]
    _, num_v_heads, dk, dv = state.shape
    assert qkv.stride(1) == 1 and a.stride() == b.stride() and a.stride(1) == 1 and state.is_contiguous()
    out = torch.empty(rows, num_v_heads, dv, dtype=qkv.dtype, device=qkv.device)
    block_v = min(32, triton.next_power_of_2(dv))
    _gdn_step_kernel[(rows, num_v_heads, triton.cdiv(dv, block_v))](
        qkv, qkv.stride(0), a, b, a.stride(0), a_log, dt_bias, state, slots, seq_lens, out, dk ** -0.5,
        HK=num_k_heads, HV=num_v_heads, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)
    return out
