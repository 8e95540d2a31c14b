"""A mixture's experts kept as their GGUF blocks (quantization="gguf" on CPU): each stacked projection of the file
(gate, up, down, or gate_up) one GGUFWeight of [experts x rows, cols], and a step dequantizes only the experts it
routes to (the torch twin; layers/fused_moe.moe_sorted takes these views as its weights). On CUDA the experts are
dequantized at load for the fused MoE kernels, which have no quantized form yet."""
import torch

from nanovllm.quant.gguf_weight import GGUFWeight


class ExpertView:
    """Expert e's dense [rows, cols] weight, dequantized from the pieces (stacked along the rows) when indexed."""

    def __init__(self, pieces: list[GGUFWeight | torch.Tensor], num_experts: int, dtype: torch.dtype):
        self.pieces, self.dtype = pieces, dtype
        self.shape = (num_experts, sum(p.shape[0] // num_experts for p in pieces), pieces[0].shape[1])

    def __getitem__(self, expert: int) -> torch.Tensor:
        parts = []
        for piece in self.pieces:
            rows = piece.shape[0] // self.shape[0]
            part = piece.narrow(0, expert * rows, rows)
            parts.append(part.dequantize() if isinstance(part, GGUFWeight) else part)
        return torch.cat(parts).to(self.dtype)


class GGUFExperts:
    def __init__(self, num_experts: int, dtype: torch.dtype):
        self.num_experts, self.dtype = num_experts, dtype
        self.parts: dict[str, GGUFWeight] = {}

    def load(self, name: str, weight: GGUFWeight | torch.Tensor):
        """name: gate_proj, up_proj, gate_up_proj or down_proj, every expert's rows at once ([experts x rows, cols];
        a dense tensor, [experts, rows, cols], where the file stores the type unquantized)."""
        if isinstance(weight, torch.Tensor):
            weight = weight.reshape(-1, weight.shape[-1]).to(self.dtype)
        if weight.shape[0] % self.num_experts:
            raise ValueError(f"expert tensor {name} has {weight.shape[0]} rows, not a multiple of the "
                             f"{self.num_experts} experts")
        self.parts[name] = weight

    def views(self) -> tuple[ExpertView, ExpertView]:
        """(w13, w2) for moe_sorted."""
        gate_up = [self.parts["gate_up_proj"]] if "gate_up_proj" in self.parts else \
            [self.parts["gate_proj"], self.parts["up_proj"]]
        return (ExpertView(gate_up, self.num_experts, self.dtype),
                ExpertView([self.parts["down_proj"]], self.num_experts, self.dtype))
