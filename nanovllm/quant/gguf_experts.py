"""A mixture's experts kept as their GGUF blocks: each stacked projection of the file (gate, up, down, or gate_up)
one GGUFWeight of [experts x rows, cols]. On CUDA, where all three are Q4_K, the fused MoE kernels read them as they
are (kernels/fused_moe_q4k.py); elsewhere on CUDA they are dequantized once loaded (dense()). On CPU a step
dequantizes only the experts it routes to (the torch twin; layers/fused_moe.moe_sorted takes these views as its
weights)."""
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
    def __init__(self, num_experts: int, dtype: torch.dtype, device: torch.device,
                 run_device: torch.device | None = None):
        """device: where the blocks load; run_device: where the experts run (the same unless they stream)."""
        self.num_experts, self.dtype, self.device = num_experts, dtype, device
        self.run_device = run_device or device
        self.parts: dict[str, GGUFWeight | torch.Tensor] = {}

    def load(self, name: str, weight: GGUFWeight | torch.Tensor):
        """name: gate_proj, up_proj, gate_up_proj or down_proj, every expert's rows at once ([experts x rows, cols];
        a dense tensor, [experts, rows, cols], where the file stores the type unquantized)."""
        if isinstance(weight, torch.Tensor):
            weight = weight.reshape(-1, weight.shape[-1]).to(self.dtype)
        if weight.shape[0] % self.num_experts:
            raise ValueError(f"expert tensor {name} has {weight.shape[0]} rows, not a multiple of the "
                             f"{self.num_experts} experts")
        self.parts[name] = weight.to(self.device)

    def q4_k(self) -> tuple[GGUFWeight, GGUFWeight, GGUFWeight] | None:
        """(gate, up, down) where all three are Q4_K blocks (the fused kernels' form), else None."""
        parts = [self.parts.get(name) for name in ("gate_proj", "up_proj", "down_proj")]
        return tuple(parts) if all(isinstance(p, GGUFWeight) and p.type_name == "Q4_K" for p in parts) else None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) dequantized, in the dtype."""
        w13, w2 = self.views()
        return (torch.stack([w13[e] for e in range(self.num_experts)]),
                torch.stack([w2[e] for e in range(self.num_experts)]))

    def stacks(self) -> dict[str, torch.Tensor]:
        """Each projection's tensors expert-major ([experts, rows, ...]: dim 0 picks an expert), named "proj.field"
        (a GGUFWeight's fields) or "proj" (a dense part)."""
        out = {}
        for proj, part in self.parts.items():
            for field, t in (part.fields.items() if isinstance(part, GGUFWeight) else (("", part),)):
                out[f"{proj}.{field}" if field else proj] = t.view(self.num_experts, -1, *t.shape[1:])
        return out

    def over(self, stacks: dict[str, torch.Tensor]) -> "GGUFExperts":
        """These projections held in stacks (as stacks() names them), of however many experts they hold."""
        first = next(iter(stacks.values()))
        experts = GGUFExperts(first.shape[0], self.dtype, first.device, self.run_device)
        for proj, part in self.parts.items():
            if isinstance(part, GGUFWeight):
                fields = {f: stacks[f"{proj}.{f}"].flatten(0, 1) for f in part.fields}
                rows = next(iter(fields.values())).shape[0]
                experts.parts[proj] = GGUFWeight(part.type_name, (rows, part.shape[1]), fields)
            else:
                experts.parts[proj] = stacks[proj].flatten(0, 1)
        return experts

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if isinstance(p, GGUFWeight) else p.numel() * p.element_size() for p in self.parts.values())

    def views(self) -> tuple[ExpertView, ExpertView]:
        """(w13, w2) for moe_sorted."""
        gate_up = [self.parts["gate_up_proj"]] if "gate_up_proj" in self.parts else \
            [self.parts["gate_proj"], self.parts["up_proj"]]
        return (ExpertView(gate_up, self.num_experts, self.dtype),
                ExpertView([self.parts["down_proj"]], self.num_experts, self.dtype))
