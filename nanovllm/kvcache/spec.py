"""What each layer keeps for a sequence, by layer kind (the idea of vLLM v1's KV cache specs). The KV sizing, the
allocator and the block manager ask these specs, so a new kind of layer adds a spec, not a branch in the runner:
- PagedAttentionSpec: attention's K and V, growing with the sequence in blocks of block_size tokens;
- StateSpec: a fixed-size state a sequence, whatever its length (linear attention: a conv state and a state matrix),
  in one slot a running sequence."""
from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class PagedAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """K and V of one block of this layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class StateSpec:
    shapes: tuple[tuple[int, ...], ...]  # each state tensor of one sequence (e.g. the conv state, the state matrix)
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        return sum(prod(shape) for shape in self.shapes) * self.dtype.itemsize


LayerSpec = PagedAttentionSpec | StateSpec


@dataclass(frozen=True)
class KVCacheSpec:
    """Every cache-holding layer's spec, in the model's order."""

    layers: tuple[LayerSpec, ...]

    @property
    def paged(self) -> list[PagedAttentionSpec]:
        return [s for s in self.layers if isinstance(s, PagedAttentionSpec)]

    @property
    def states(self) -> list[StateSpec]:
        return [s for s in self.layers if isinstance(s, StateSpec)]

    @property
    def block_bytes(self) -> int:
        """One KV block across every paged layer."""
        return sum(s.page_bytes for s in self.paged)

    @property
    def slot_bytes(self) -> int:
        """One sequence's state across every state layer."""
        return sum(s.slot_bytes for s in self.states)

    def num_blocks(self, budget_bytes: int, max_num_seqs: int) -> int:
        """Blocks that budget_bytes hold once every running sequence's state slot is taken from it."""
        return max(0, int(budget_bytes - max_num_seqs * self.slot_bytes)) // max(1, self.block_bytes)


def model_kv_cache_spec(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """The spec of every module of model that holds a cache (each has a kv_cache_spec(block_size, dtype) method)."""
    return KVCacheSpec(tuple(m.kv_cache_spec(block_size, dtype) for m in model.modules() if hasattr(m, "kv_cache_spec")))
