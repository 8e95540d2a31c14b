"""Every decoder layer of a one-sequence decode step in one persistent CUDA kernel: csrc/decode_layers.cu, whose
header says why. Built with nvcc at first use (NANOVLLM_CACHE) and called through ctypes; CUDA graphs capture it
like any kernel. Hopper and newer. OFF unless NANOVLLM_DECODE_LAYERS=1: on the H100 it is correct but slower than
the kernel-by-kernel path (Qwen3-0.6B bs=1: 1,085-1,089 vs 1,206-1,208 tok/s in the same calls; docs/benchmarks.md).
Twin: the model's own layers (LlamaModel.forward without it), which tests/test_decode_layers.py compares it to."""
import ctypes
import os

import torch

from nanovllm.kernels import cuda_library, pdl
from nanovllm.logger import log_once

SPLIT_POSITIONS = 64  # kCap of the .cu: context positions of one attention split, one CTA each
TILE_BYTES = 32 * 1024  # kTileBytes: a weight tile's rows
SLOT_BYTES = TILE_BYTES + 1024  # kSlotBytes: the tile at a padded row stride
MAX_SLOTS = 16
SMEM_BUDGET = 227 * 1024 - 12 * 1024  # dynamic shared memory a CTA may take: the SM's 227 KB less the static part
MAX_HIDDEN = 8192  # the normed input row lives in registers, 4 packs of 8 a consumer thread
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_STAGES = 5



class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
                                                     "input_norm", "post_norm", "q_norm", "k_norm", "k_cache",
                                                     "v_cache")]


class _Params(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("layers", "hidden", "qkv", "attn", "act", "partials",
                                                      "counters", "block_table", "seq_lens", "slot_mapping", "cos",
                                                      "sin")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_int) for name in ("num_layers", "hidden_size", "heads", "kv_heads", "inter")]
                + [(name, ctypes.c_int64) for name in ("stride_cb", "stride_cs", "stride_ch")]
                + [(name, ctypes.c_int) for name in ("page", "splits", "rows_qkv", "rows_o", "rows_gate_up",
                                                     "rows_down", "slots")]
                + [("stamps", ctypes.c_void_p)])


def why_off(device: torch.device) -> str | None:
    """None when the kernel is built and can run on this device, else why not (the caller logs its choice)."""
    return cuda_library.entry_point(
        "decode_layers", device, "NANOVLLM_DECODE_LAYERS",
        [ctypes.c_int, ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])


def _library() -> ctypes.CDLL:
    return cuda_library.library("decode_layers")


def tile_rows(k: int, element: int, parts: int = 1) -> int:
    """Rows of a weight tile: the largest power of two whose rows (of each of `parts` halves) fill a slot, at most
    64 rows in all (the padding budget of a slot)."""
    rows = 1
    while 2 * rows * parts * k * element <= TILE_BYTES and 2 * rows * parts <= 64:
        rows *= 2
    return rows


def _slots(max_k: int, head_dim: int, element: int, num_layers: int) -> int:
    besides = 2 * SPLIT_POSITIONS * head_dim * element + max_k * element + num_layers * ctypes.sizeof(_LayerWeights)
    return min(MAX_SLOTS, (SMEM_BUDGET - besides) // SLOT_BYTES)


def why_not(model, max_model_len: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when this model's bs=1 decode steps can run the kernel, else why not."""
    if os.environ.get("NANOVLLM_DECODE_LAYERS", "0") != "1":
        return "off unless NANOVLLM_DECODE_LAYERS=1: slower than kernel by kernel on the H100 so far"
    inner = model.model
    layer = inner.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    group = attn.num_heads // attn.num_kv_heads
    element = torch.tensor([], dtype=dtype).element_size()
    hidden, inter, q_size = layer.input_layernorm.weight.numel(), mlp.down_proj.weight.shape[1], attn.o_proj.weight.shape[1]
    if dtype not in _DTYPES:
        return f"{dtype} (bf16 and fp16 only)"
    if attn.head_dim not in (64, 128) or group not in (1, 2, 4, 8) or attn.num_heads % attn.num_kv_heads:
        return f"head_dim {attn.head_dim}, {attn.num_heads} heads over {attn.num_kv_heads} kv heads"
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if max_model_len > sms // attn.num_kv_heads * SPLIT_POSITIONS:
        return (f"max_model_len {max_model_len} > {sms // attn.num_kv_heads * SPLIT_POSITIONS} (one CTA per "
                f"{SPLIT_POSITIONS} positions of each kv head)")
    if hidden > MAX_HIDDEN or any(k % 16 or k < 256 or k * element * 2 > TILE_BYTES for k in (hidden, q_size, inter)):
        return f"hidden {hidden}, intermediate {inter}: a row does not fit a weight tile"
    if _slots(max(hidden, q_size, inter), attn.head_dim, element, len(inner.layers)) < 2:
        return "shared memory: fewer than two weight tiles fit"
    for lyr in inner.layers:
        linears = (lyr.self_attn.qkv_proj, lyr.self_attn.o_proj, lyr.mlp.gate_up_proj, lyr.mlp.down_proj)
        for lin in linears:
            w = lin.weight
            if w.dtype != dtype or not w.is_contiguous() or w.data_ptr() % 16 or not w.is_cuda:
                return f"{type(lin).__name__} weight is not a plain contiguous {dtype} tensor (quantized?)"
        if lyr.mlp.gate_up_proj.bias is not None or lyr.mlp.down_proj.bias is not None:
            return "MLP biases"
        if lyr.self_attn.attn.k_cache is None:
            return "no KV cache"
    return why_off(device)


class DecodeLayers:
    """The kernel's arguments for one loaded model and its KV cache; call it on a bs=1 decode step's embedding."""

    def __init__(self, model):
        inner = model.model
        first = inner.layers[0]
        attn = first.self_attn
        weight = first.self_attn.qkv_proj.weight
        self.device, self.dtype = weight.device, weight.dtype
        element = weight.element_size()
        hidden, inter = first.input_layernorm.weight.numel(), first.mlp.down_proj.weight.shape[1]
        q_size = attn.num_heads * attn.head_dim
        self.head_dim, self.max_k = attn.head_dim, max(hidden, q_size, inter)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        splits = sms // attn.num_kv_heads
        group = attn.num_heads // attn.num_kv_heads
        ptr = cuda_library.pointer
        rows = []
        for lyr in inner.layers:
            sa, mlp = lyr.self_attn, lyr.mlp
            rows.append(_LayerWeights(
                ptr(sa.qkv_proj.weight), ptr(sa.qkv_proj.bias), ptr(sa.o_proj.weight), ptr(sa.o_proj.bias),
                ptr(mlp.gate_up_proj.weight), ptr(mlp.down_proj.weight), ptr(lyr.input_layernorm.weight),
                ptr(lyr.post_attention_layernorm.weight), ptr(sa.q_norm.weight if sa.q_norm else None),
                ptr(sa.k_norm.weight if sa.k_norm else None), ptr(sa.attn.k_cache), ptr(sa.attn.v_cache)))
        table = (_LayerWeights * len(rows))(*rows)
        self.layers = torch.frombuffer(bytearray(bytes(table)), dtype=torch.uint8).to(self.device)
        make = dict(dtype=self.dtype, device=self.device)
        self.qkv = torch.empty(q_size + 2 * attn.num_kv_heads * attn.head_dim, **make)
        self.attn_out = torch.empty(q_size, **make)
        self.act = torch.empty(inter, **make)
        self.partials = torch.empty(attn.num_kv_heads * splits * group * (attn.head_dim + 2), dtype=torch.float32,
                                    device=self.device)
        # zero between launches: the kernel's last CTA zeroes them again
        self.counters = torch.zeros(len(rows) * (_STAGES + attn.num_kv_heads) + 1, dtype=torch.int32,
                                    device=self.device)
        cos, sin = attn.rotary.tables(self.dtype)
        k_cache = attn.attn.k_cache
        self.params = _Params(
            self.layers.data_ptr(), None, self.qkv.data_ptr(), self.attn_out.data_ptr(), self.act.data_ptr(),
            self.partials.data_ptr(), self.counters.data_ptr(), None, None, None, cos.data_ptr(), sin.data_ptr(),
            first.input_layernorm.eps, attn.attn.scale, len(rows), hidden, attn.num_heads, attn.num_kv_heads, inter,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], splits,
            tile_rows(hidden, element), tile_rows(q_size, element), tile_rows(hidden, element, 2),
            tile_rows(inter, element), _slots(self.max_k, attn.head_dim, element, len(rows)))
        self._tables = (cos, sin)
        self.stamps: torch.Tensor | None = None  # [CTAs, layers, 2, 48] int64 phase stamps (scripts/decode_layers_phases.py)
        log_once(f"bs=1 decode steps run every layer in one kernel (csrc/decode_layers.cu: {sms} CTAs, "
                 f"{self.params.slots} weight tiles of {SLOT_BYTES // 1024} KB in flight each)")

    @staticmethod
    def takes(meta) -> bool:
        return meta.num_seqs == 1 and meta.num_decodes == 1

    def __call__(self, hidden: torch.Tensor, meta):
        """hidden: [1, hidden_size] the step's embedding, contiguous; replaced in place by the residual stream after
        the last layer (the model's final norm comes next)."""
        assert hidden.is_contiguous() and hidden.dtype == self.dtype and meta.block_tables.stride(1) == 1
        p = self.params
        p.hidden = hidden.data_ptr()
        p.block_table, p.seq_lens = meta.block_tables.data_ptr(), meta.seq_lens.data_ptr()
        p.slot_mapping = meta.slot_mapping.data_ptr()
        p.stamps = None if self.stamps is None else self.stamps.data_ptr()
        error = _library().nanovllm_decode_layers(_DTYPES[self.dtype], ctypes.byref(p), self.head_dim, self.max_k,
                                                  int(pdl.why_off(self.device) is None),
                                                  cuda_library.stream_of(hidden))
        cuda_library.check(_library(), error, "decode_layers")
