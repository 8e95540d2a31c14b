"""Mixture-of-experts MLP: each token runs through its top-k experts (SiLU-gated MLPs) and sums their outputs
weighted by the router. On the GPU the fused Triton kernels (kernels/fused_moe.py: one grouped launch a projection,
CUDA graphs capture it); here the plain torch path beside them: the token-expert pairs sorted by expert, then one
gate_up and one down matmul for each expert's contiguous rows (it reads the row counts on the host)."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.custom_op import CustomOp


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): softmax in fp32, the top k, optionally renormalized
    to sum to one (Qwen3-MoE's router)."""
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def moe_sorted(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; weights, ids [T, k] (an id of -1: a pair
    left out, its expert not among these)."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    order = torch.where(flat < 0, w13.shape[0], flat).argsort(stable=True)  # pairs left out sort last
    tokens = order // top_k  # each sorted pair's token
    counts = torch.bincount(flat[flat >= 0], minlength=w13.shape[0]).tolist()
    rows = x[tokens]
    out = torch.zeros(order.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            gate, up = F.linear(rows[start:start + count], w13[expert]).chunk(2, dim=-1)
            out[start:start + count] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    out *= weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, out)


def moe_per_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """The reference: each token's k experts one at a time (the tests' twin of moe_sorted)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(weights[t], ids[t].tolist()):
            gate, up = F.linear(x[t], w13[expert]).chunk(2, dim=-1)
            out[t] += weight * F.linear(F.silu(gate) * up, w2[expert])
    return out


class FusedMoE(CustomOp):
    """num_experts SiLU-gated MLPs of hidden_size -> intermediate_size -> hidden_size, their weights stacked; each
    token runs the top_k that its router logits pick (renormalized to sum to one where the model says so). With
    experts past the GPU (streaming/expert_offload.py), the layer holds the resident ones (w13 and w2, or the
    quantized blocks) and `offload` runs them; stacks() / hold() / run_held() give it the experts in any rows."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.num_experts = num_experts
        self.offload = None  # streaming/expert_offload.py: the experts past the GPU
        self.quantized = None  # experts kept as a file's quantized blocks (quant/gguf_experts.py), which the model sets

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits)
        if self.offload is not None:
            return self.offload.run(self, x, weights, ids)
        if self.quantized is not None:
            return self._run_quantized(x, self.quantized, weights, ids)
        return self.experts(x, self.w13, self.w2, weights, ids)

    @staticmethod
    def _run_quantized(x: torch.Tensor, experts, weights: torch.Tensor, ids: torch.Tensor,
                       leaves_out: bool = False) -> torch.Tensor:
        if x.is_cuda:
            from nanovllm.kernels.fused_moe_q4k import fused_moe_q4k

            return fused_moe_q4k(x, *experts.q4_k(), weights, ids, experts.num_experts, leaves_out=leaves_out)
        return moe_sorted(x, *experts.views(), weights, ids)

    def stacks(self) -> dict[str, torch.Tensor]:
        """The held experts' weights expert-major (dim 0 picks an expert), by name: w13 and w2, or the fields of the
        quantized blocks (quant/gguf_experts.py)."""
        return self.quantized.stacks() if self.quantized is not None else {"w13": self.w13.data, "w2": self.w2.data}

    def hold(self, stacks: dict[str, torch.Tensor]):
        """Make stacks (as stacks() names them, of any number of experts) the layer's own experts."""
        if self.quantized is not None:
            self.quantized = self.quantized.over(stacks)
        else:
            self.w13, self.w2 = (nn.Parameter(stacks[name], requires_grad=False) for name in ("w13", "w2"))

    def run_held(self, x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                 stacks: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The experts in stacks (None: the layer's own) on the pairs whose rows [T, k] index them (-1: a pair left
        out)."""
        if self.quantized is not None:
            experts = self.quantized if stacks is None else self.quantized.over(stacks)
            return self._run_quantized(x, experts, weights, rows, leaves_out=True)
        w13, w2 = (self.w13, self.w2) if stacks is None else (stacks["w13"], stacks["w2"])
        return self.experts(x, w13, w2, weights, rows, leaves_out=True)

    def settle_quantized(self):
        """Once loaded: where they run on CUDA, experts the fused kernels cannot read as blocks (types other than
        Q4_K) are dequantized into w13 / w2, logged once."""
        if self.quantized.run_device.type != "cuda" or self.quantized.q4_k() is not None:
            return
        from nanovllm.logger import log_once

        log_once("experts of GGUF types other than Q4_K are dequantized at load (the fused MoE kernels read Q4_K "
                 "blocks only)")
        w13, w2 = self.quantized.dense()
        self.w13, self.w2 = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))
        self.quantized = None

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.use_triton:
            from nanovllm.kernels.fused_moe import route

            return route(router_logits, self.top_k, self.renormalize)
        return route_top_k(router_logits, self.top_k, self.renormalize)

    def experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                leaves_out: bool = False) -> torch.Tensor:
        """The experts w13 / w2 on the pairs ids [T, k] (rows of w13; leaves_out: -1 for a pair left out)."""
        if self.use_triton:
            from nanovllm.kernels.fused_moe import fused_moe

            return fused_moe(x, w13, w2, weights, ids, leaves_out=leaves_out)
        return moe_sorted(x, w13, w2, weights, ids)

    def load_expert(self, name: str, tensor: torch.Tensor, expert: int | None):
        """One checkpoint tensor: an expert's gate_proj / up_proj / down_proj ([I, H] / [I, H] / [H, I]), or every
        expert's at once (expert None: those stacked [E, ...] as GGUF files hold them, or gate_up_proj [E, 2I, H];
        a stacked tensor stored input-major, [E, H, 2I], is transposed)."""
        inter = self.w2.shape[2]
        targets = {"gate_proj": (self.w13, slice(0, inter)), "up_proj": (self.w13, slice(inter, 2 * inter)),
                   "gate_up_proj": (self.w13, slice(None)), "down_proj": (self.w2, slice(None))}
        if name not in targets:
            raise ValueError(f"an expert tensor {name!r}: expected gate_proj, up_proj, down_proj or gate_up_proj")
        param, rows = targets[name]
        target = param.data[:, rows] if expert is None else param.data[expert, rows]
        if expert is None and tensor.shape != target.shape and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)  # stored input-major
        if tensor.shape != target.shape:
            raise ValueError(f"expert tensor {name} (expert {'all' if expert is None else expert}) has shape "
                             f"{tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
