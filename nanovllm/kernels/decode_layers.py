"""Every decoder layer of a one-sequence decode step in one persistent CUDA kernel: csrc/decode_layers.cu, whose
header says why. Built with nvcc at first use (NANOVLLM_CACHE) and called through ctypes; CUDA graphs capture it
like any kernel. Hopper and newer. OFF unless NANOVLLM_DECODE_LAYERS=1: on the H100 it is correct but slower than
the kernel-by-kernel path (Qwen3-0.6B bs=1: 1,085-1,103 vs 1,205-1,208 tok/s in the same calls; docs/benchmarks.md).
Twin: the model's own layers (LlamaModel.forward without it), which tests/test_decode_layers.py compares it to."""
import ctypes
import os
from typing import NamedTuple

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
        [ctypes.c_int, ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int, ctypes.c_void_p])


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


class _Shape(NamedTuple):
    """What the kernel's launch depends on, from the model's first layer and the device."""
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    element: int
    sms: int

    @classmethod
    def of(cls, model, dtype: torch.dtype, device: torch.device) -> "_Shape":
        layer = model.model.layers[0]
        attn = layer.self_attn
        return cls(layer.input_layernorm.weight.numel(), layer.mlp.down_proj.weight.shape[1], attn.num_heads,
                   attn.num_kv_heads, attn.head_dim, len(model.model.layers),
                   torch.tensor([], dtype=dtype).element_size(),
                   torch.cuda.get_device_properties(device).multi_processor_count)

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def max_k(self) -> int:  # the longest reduction: hidden (qkv, gate_up), q_size (o), inter (down)
        return max(self.hidden, self.q_size, self.inter)

    @property
    def splits(self) -> int:  # attention splits of each kv head, one CTA each
        return self.sms // self.kv_heads

    @property
    def slots(self) -> int:
        return _slots(self.max_k, self.head_dim, self.element, self.layers)


def why_not(model, max_model_len: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when this model's bs=1 decode steps can run the kernel, else why not."""
    if os.environ.get("NANOVLLM_DECODE_LAYERS", "0") != "1":
        return "off unless NANOVLLM_DECODE_LAYERS=1: slower than kernel by kernel on the H100 so far"
    if dtype not in _DTYPES:
        return f"{dtype} (bf16 and fp16 only)"
    shape = _Shape.of(model, dtype, device)
    group = shape.heads // shape.kv_heads
    if shape.head_dim not in (64, 128) or shape.heads % shape.kv_heads or group not in (1, 2, 4, 8):
        return f"head_dim {shape.head_dim}, {shape.heads} heads over {shape.kv_heads} kv heads"
    if max_model_len > shape.splits * SPLIT_POSITIONS:
        return (f"max_model_len {max_model_len} > {shape.splits * SPLIT_POSITIONS} (one CTA per "
                f"{SPLIT_POSITIONS} positions of each kv head)")
    ks = (shape.hidden, shape.q_size, shape.inter)
    if shape.hidden > MAX_HIDDEN or any(k % 16 or k < 256 or k * shape.element * 2 > TILE_BYTES for k in ks):
        return f"hidden {shape.hidden}, intermediate {shape.inter}: a row does not fit a weight tile"
    if shape.slots < 2:
        return "shared memory: fewer than two weight tiles fit"
    for lyr in model.model.layers:
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
        weight = model.model.layers[0].self_attn.qkv_proj.weight
        self.device, self.dtype = weight.device, weight.dtype
        shape = _Shape.of(model, self.dtype, self.device)
        self.head_dim = shape.head_dim
        ptr = cuda_library.pointer
        rows = []
        for lyr in model.model.layers:
            sa, mlp = lyr.self_attn, lyr.mlp
            rows.append(_LayerWeights(
                ptr(sa.qkv_proj.weight), ptr(sa.qkv_proj.bias), ptr(sa.o_proj.weight), ptr(sa.o_proj.bias),
                ptr(mlp.gate_up_proj.weight), ptr(mlp.down_proj.weight), ptr(lyr.input_layernorm.weight),
                ptr(lyr.post_attention_layernorm.weight), ptr(sa.q_norm.weight if sa.q_norm else None),
                ptr(sa.k_norm.weight if sa.k_norm else None), ptr(sa.attn.k_cache), ptr(sa.attn.v_cache)))
        table = (_LayerWeights * len(rows))(*rows)
        self.layers = torch.frombuffer(bytearray(bytes(table)), dtype=torch.uint8).to(self.device)
        make = dict(dtype=self.dtype, device=self.device)
        self.qkv = torch.empty(shape.q_size + 2 * shape.kv_heads * shape.head_dim, **make)
        self.attn_out = torch.empty(shape.q_size, **make)
        self.act = torch.empty(shape.inter, **make)
        self.partials = torch.empty(shape.kv_heads * shape.splits * (shape.heads // shape.kv_heads)
                                    * (shape.head_dim + 2), dtype=torch.float32, device=self.device)
        # zero between launches: the kernel's last CTA zeroes them again
        self.counters = torch.zeros(shape.layers * (_STAGES + shape.kv_heads) + 1, dtype=torch.int32,
                                    device=self.device)
        first = model.model.layers[0]
        cos, sin = first.self_attn.rotary.tables(self.dtype)  # cast once and kept by the rotary embedding
        k_cache, element = first.self_attn.attn.k_cache, shape.element
        self.params = _Params(
            self.layers.data_ptr(), None, self.qkv.data_ptr(), self.attn_out.data_ptr(), self.act.data_ptr(),
            self.partials.data_ptr(), self.counters.data_ptr(), None, None, None, cos.data_ptr(), sin.data_ptr(),
            first.input_layernorm.eps, first.self_attn.attn.scale, shape.layers, shape.hidden, shape.heads,
            shape.kv_heads, shape.inter, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
            shape.splits, tile_rows(shape.hidden, element), tile_rows(shape.q_size, element),
            tile_rows(shape.hidden, element, 2), tile_rows(shape.inter, element), shape.slots)
        # [CTAs, layers, 2, 48] int64 phase stamps (scripts/decode_layers_phases.py)
        self.stamps: torch.Tensor | None = None
        log_once(f"bs=1 decode steps run every layer in one kernel (csrc/decode_layers.cu: {shape.sms} CTAs, "
                 f"{shape.slots} weight tiles of {SLOT_BYTES // 1024} KB in flight each)")

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
        error = _library().nanovllm_decode_layers(_DTYPES[self.dtype], ctypes.byref(p), self.head_dim,
                                                  int(pdl.why_off(self.device) is None),
                                                  cuda_library.stream_of(hidden))
        cuda_library.check(_library(), error, "decode_layers")
