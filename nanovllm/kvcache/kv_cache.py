"""The KV cache's size and tensors: how many device blocks (set, or what memory is left after a profiling forward),
how many host blocks (kv_offloading_size), the device cache itself and each layer's views of it, and the host pool
with the ring that attends to offloaded blocks and the layer-major prefill."""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.host_memory import require_host_memory
from nanovllm.kvcache.host_pool import HostKVPool
from nanovllm.kvcache.layer_major import LayerMajorPrefill
from nanovllm.kvcache.offload_engine import OFFLOAD_SLOT_BYTES, OFFLOAD_SLOTS, OffloadEngine, slot_blocks
from nanovllm.kvcache.spec import KVCacheSpec, PagedAttentionSpec
from nanovllm.logger import logger

CPU_KV_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class KVCacheLayout:
    num_gpu_blocks: int
    num_host_blocks: int  # 0: no host pool
    block_size: int
    block_bytes: int  # one block across every layer
    num_state_slots: int = 0  # linear-attention layers: a state slot a running sequence (0: no such layers)
    slot_bytes: int = 0  # one slot across every such layer

    @property
    def prefix_caching_off(self) -> str | None:
        """Why the prefix cache cannot serve this model (None: it can)."""
        if self.num_state_slots:
            return ("linear-attention layers keep one state a sequence, not one a block (a snapshot at each block "
                    f"boundary would take {self.slot_bytes / self.block_bytes:.0f} blocks' worth of memory)")
        return None

    def describe(self, device: torch.device, max_model_len: int) -> str:
        tokens = self.num_gpu_blocks * self.block_size
        host = f"; {self.num_host_blocks} in host memory" if self.num_host_blocks else ""
        states = (f"; {self.num_state_slots} state slots of {self.slot_bytes / (1 << 20):.2f} MiB"
                  if self.num_state_slots else "")
        return (f"{self.num_gpu_blocks} blocks of {self.block_size} tokens "
                f"({self.num_gpu_blocks * self.block_bytes / (1 << 30):.2f} GiB on {device}){host}{states}; maximum "
                f"concurrency for {max_model_len:,} tokens a sequence: {tokens / max_model_len:.2f}x")


def num_host_blocks(kv_offloading_size: float | None, spec: KVCacheSpec) -> int:
    return 0 if kv_offloading_size is None else int(kv_offloading_size * (1 << 30)) // spec.block_bytes


def num_device_blocks(config, spec: KVCacheSpec, device: torch.device, profile: Callable[[], int],
                      reserved_bytes: int) -> int:
    """num_gpu_blocks_override, or the blocks kv_cache_memory_bytes holds, or on CPU CPU_KV_CACHE_BYTES', or on GPU
    what gpu_memory_utilization leaves after the weights, `reserved_bytes` and the activation peak that profile()
    returns (as vLLM)."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory_bytes is not None:
        return spec.num_blocks(config.kv_cache_memory_bytes, config.max_num_seqs)
    if device.type == "cpu":
        return spec.num_blocks(CPU_KV_CACHE_BYTES, config.max_num_seqs)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    activation_peak = profile()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = total * config.gpu_memory_utilization - (total - free) - activation_peak - reserved_bytes
    num_blocks = spec.num_blocks(budget, config.max_num_seqs)
    if num_blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory is left for the KV cache: {(total - free) / gib:.1f} GiB in use and "
            f"{activation_peak / gib:.1f} GiB of activations, of {total / gib:.1f} GiB at "
            f"gpu_memory_utilization={config.gpu_memory_utilization}: raise gpu_memory_utilization, "
            f"lower max_num_batched_tokens or max_num_seqs, stream weights from host memory (cpu_offload_gb) "
            f"or use a smaller model")
    return num_blocks


@torch.inference_mode()
def activation_peak(model, config, device: torch.device, logit_rows: int, prefill_graphs: bool) -> int:
    """Bytes of activations at the largest step: a forward over max_num_batched_tokens tokens with no KV cache, then
    the sampler's temporaries for logit_rows rows (max_num_seqs, or a prompt-logprobs chunk where more). The prefill
    graphs' own pool holds a forward's activations too."""
    lens, left = [], config.max_num_batched_tokens
    while left > 0:
        lens.append(min(left, config.model_config.max_model_len))
        left -= lens[-1]
    num_tokens = sum(lens)
    starts = np.concatenate([[0], np.cumsum(lens)]).tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
        num_decodes=0, max_query_len=max(lens), max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(ids, positions, meta)
    logits = model.compute_logits(hidden[:min(logit_rows, num_tokens)])
    logits.float().log_softmax(-1).sort(dim=-1)  # the sampler's largest temporaries
    del hidden, logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return 2 * peak if prefill_graphs else peak


def check_capacity(num_gpu_blocks: int, num_host: int, block_size: int, max_model_len: int):
    capacity = (num_gpu_blocks + num_host) * block_size
    if capacity < max_model_len or num_gpu_blocks < 2:
        where = f" and {num_host} in host memory" if num_host else ""
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_gpu_blocks} blocks of {block_size}{where}), fewer than "
            f"max_model_len={max_model_len} (or fewer than 2 device blocks): raise kv_cache_memory_bytes (CPU) or "
            f"gpu_memory_utilization (GPU) or num_gpu_blocks_override or kv_offloading_size, or lower max_model_len")


def offload_reserve_bytes(spec: KVCacheSpec, max_model_len: int, hidden_bytes_per_token: int) -> int:
    """GPU memory that KV in host memory takes besides the cache: the ring's slots, and the staging buffers and
    hidden states of a prompt prefilled a layer at a time."""
    per_layer = spec.block_bytes // (spec.paged[0].block_size * len(spec.paged))
    return OFFLOAD_SLOTS * OFFLOAD_SLOT_BYTES + LayerMajorPrefill.bytes_needed(max_model_len, per_layer,
                                                                               hidden_bytes_per_token)


def allocate_kv_cache(model, spec: KVCacheSpec, layout: KVCacheLayout, max_num_seqs: int,
                      device: torch.device) -> torch.Tensor:
    """The paged layers' cache, [2, layers, blocks + 1, block_size, kv_heads, head_dim] (one block more than the block
    manager hands out: the scratch block that CUDA-graph padding rows use), each layer bound to its K and V views; and
    each state layer bound to its own state slots, max_num_seqs of them."""
    layers = [m for m in model.modules() if hasattr(m, "kv_cache_spec")]
    paged = spec.paged
    kv_cache = torch.empty((2, len(paged), layout.num_gpu_blocks + 1, layout.block_size, paged[0].num_kv_heads,
                            paged[0].head_dim), dtype=paged[0].dtype, device=device) if paged else None
    index = 0
    for layer, layer_spec in zip(layers, spec.layers):
        if isinstance(layer_spec, PagedAttentionSpec):
            layer.bind_kv_cache(kv_cache[0, index], kv_cache[1, index])
            index += 1
        else:
            layer.bind_kv_cache(*(torch.zeros(max_num_seqs, *shape, dtype=layer_spec.dtype, device=device)
                                  for shape in layer_spec.shapes))
    return kv_cache


@dataclass
class HostTier:
    """KV in host memory: the pool's blocks, the ring that attends to them, and the layer-major prefill (None where
    weights stream: they would be fetched again for every chunk of a layer; and where layers keep a state a sequence,
    which a prompt's chunks would each start from zeros)."""

    pool: HostKVPool
    offload_engine: OffloadEngine
    layer_major: LayerMajorPrefill | None


def make_host_tier(config, model, attention_layers: list, kv_cache: torch.Tensor, layout: KVCacheLayout, fast: bool,
                   layer_major: bool) -> HostTier:
    gib, num_blocks = config.kv_offloading_size, layout.num_host_blocks
    require_host_memory(num_blocks * layout.block_bytes, f"kv_offloading_size={gib:g}")
    if num_blocks < 1:
        raise ValueError(f"kv_offloading_size={gib} GiB holds no KV block ({layout.block_bytes} bytes each): raise it")
    pool = HostKVPool(kv_cache, num_blocks)
    engine = OffloadEngine(pool.pool, OFFLOAD_SLOTS, slot_blocks(pool.pool), kv_cache.device, fast=fast)
    engine.warm_up(attention_layers[0].num_heads)
    for i, attn in enumerate(attention_layers):
        attn.layer_index, attn.offload_engine = i, engine
    layer_major = LayerMajorPrefill(model, kv_cache, pool.pool, config.model_config.max_model_len,
                                    config.max_num_batched_tokens, fast) if layer_major else None
    logger.debug(f"KV in host memory: {num_blocks} blocks ({gib:g} GiB); offloaded blocks are attended to through "
                 f"{OFFLOAD_SLOTS} slots of {engine.slot_blocks} blocks")
    return HostTier(pool, engine, layer_major)
