"""The flash_attn backend against the torch reference. On CPU (and wherever flash_attn is not installed) its two
flash-attn entry points are a plain stand-in written here from flash-attn's documented semantics (paged K/V
through block_table, causal masks aligned to the end of each context, GQA): that checks what the backend passes
them. Where flash_attn is importable on a GPU, the same tests run on the real kernels."""
import sys
import types

import pytest
import torch
from test_triton_kernels import _step

from nanovllm.attention import flash_attn_backend
from nanovllm.attention.selector import get_attention_backend
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.platform import default_block_size

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged_attention(q, k_cache, v_cache, block_table, q_lens, k_lens, scale, causal):
    """q: [sum q_lens, H, D] -> same; sequence b attends to its first k_lens[b] cached positions."""
    out = torch.empty_like(q)
    page = k_cache.shape[1]
    start = 0
    for b, (n_q, n_k) in enumerate(zip(q_lens, k_lens)):
        positions = torch.arange(n_k, device=q.device)
        slots = block_table[b, positions // page].long() * page + positions % page
        keys = k_cache.flatten(0, 1)[slots].float()
        values = v_cache.flatten(0, 1)[slots].float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n_q].float(), keys) * scale
        if causal:  # query i sits at context position n_k - n_q + i
            allowed = positions[None, :] <= (n_k - n_q + torch.arange(n_q, device=q.device))[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:start + n_q] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
        start += n_q
    return out


def _stand_in():
    module = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False, block_table=None):
        q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
        assert block_table is not None and max(q_lens) == max_seqlen_q and max(k_lens) == max_seqlen_k
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
        return _paged_attention(q, k, v, block_table, q_lens, k_lens, softmax_scale, causal)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                                causal=False):
        assert q.shape[1] == 1 and cache_seqlens.dtype == torch.int32
        out = _paged_attention(q.squeeze(1), k_cache, v_cache, block_table, [1] * q.shape[0], cache_seqlens.tolist(),
                               softmax_scale, causal)
        return out.unsqueeze(1)

    module.flash_attn_varlen_func, module.flash_attn_with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
    return module


@pytest.fixture
def flash_attn(monkeypatch):
    """The real flash_attn where it is importable on a GPU, else the stand-in."""
    flash_attn_backend.flash_attn_available.cache_clear()
    if not (DEVICE == "cuda" and flash_attn_backend.flash_attn_available()):
        monkeypatch.setitem(sys.modules, "flash_attn", _stand_in())
        flash_attn_backend.flash_attn_available.cache_clear()
    yield
    flash_attn_backend.flash_attn_available.cache_clear()


@pytest.mark.parametrize("new", [[1, 1, 1], [1, 9, 23], [4, 17, 40]])
def test_flash_attn_backend_matches_torch_backend(new, flash_attn):
    """Decode steps, a mixed step (a decode beside prefills over cached prefixes) and whole prompts, in bf16 (what
    flash-attn runs): the same outputs, and the same cache after the backend stored the step's keys and values."""
    if DEVICE == "cpu":
        pytest.importorskip("triton")  # the K/V store kernel runs under the interpreter
    g = torch.Generator().manual_seed(3)
    meta, k_cache, v_cache = _step(new, 4, 2, 64, g, seq_lens=(4, 17, 40) if new == [4, 17, 40] else (1, 17, 40),
                                   page=256)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    tokens = sum(new)
    q, k, v = (torch.randn(tokens, heads, 64, generator=g).to(DEVICE, torch.bfloat16) for heads in (4, 2, 2))
    outputs, caches = [], []
    for backend in (TorchAttentionBackend(), flash_attn_backend.FlashAttnBackend(256, torch.bfloat16, 64, torch.device(DEVICE))):
        kc, vc = k_cache.clone(), v_cache.clone()
        outputs.append(backend.forward(q, k, v, kc, vc, meta, 0.125))
        caches.append((kc, vc))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-2, rtol=1e-2)
    for got, want in zip(caches[1], caches[0]):
        torch.testing.assert_close(got.nan_to_num(7.0), want.nan_to_num(7.0), atol=0, rtol=0)


@pytest.mark.parametrize("rotate_here", [False, True])
@pytest.mark.parametrize("new", [[1, 1, 1], [1] * 6, [1, 9, 23]])
def test_qwen3_attention_on_flash_attn_matches_torch_backend(new, rotate_here, flash_attn, monkeypatch):
    """Qwen3's attention layer in bf16: on a GPU, decode steps of up to 4 sequences take the CUDA decode kernel
    (q/k norms and rotary inside it), longer ones the rotary kernel, then flash-attn; prefills flash-attn.
    rotate_here: the CUDA kernel serves the engine but takes no step, so every decode step goes through the rotary
    kernel (on CPU too, under the interpreter). Output and cache as the torch backend after the rotary twin."""
    from transformers import Qwen3Config

    from nanovllm.kernels import paged_decode_cluster
    from nanovllm.layers.rotary_embedding import RotaryEmbedding
    from nanovllm.models.llama import LlamaAttention
    from nanovllm.rope_scaling import rope_parameters

    if DEVICE == "cpu":
        pytest.importorskip("triton")  # the K/V store and rotary kernels run under the interpreter
    declined = []
    if rotate_here:
        monkeypatch.setattr(paged_decode_cluster, "serves", lambda *args: True)
        monkeypatch.setattr(paged_decode_cluster, "decode_step", lambda *args: declined.append(1))
    config = Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=256)
    g = torch.Generator().manual_seed(9)
    rotary = RotaryEmbedding(64, 256, rope_parameters(config))
    layer = LlamaAttention(config, rotary, qkv_bias=False, o_bias=False, qk_norm=True).to(DEVICE, torch.bfloat16)
    for param in layer.parameters():
        param.data = (torch.randn(param.shape, generator=g) * 0.2 + (1 if param.dim() == 1 else 0)).to(param)
    seq_lens = [(1, 17, 40, 5, 70, 200)[i] for i in range(len(new))]
    meta, k_cache, v_cache = _step(new, 4, 2, 64, g, seq_lens=seq_lens, page=256)
    k_cache, v_cache = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(meta.seq_lens_cpu, new)]).to(DEVICE)
    qkv = torch.randn(sum(new), (4 + 2 * 2) * 64, generator=g).to(DEVICE, torch.bfloat16)
    outputs, caches = [], []
    for backend in (TorchAttentionBackend(),
                    flash_attn_backend.FlashAttnBackend(256, torch.bfloat16, 256, torch.device(DEVICE))):
        layer.attn.backend, layer.attn.k_cache, layer.attn.v_cache = backend, k_cache.clone(), v_cache.clone()
        outputs.append(layer(positions, qkv.clone(), meta))
        caches.append((layer.attn.k_cache, layer.attn.v_cache))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-2, rtol=2e-2)
    for got, want in zip(caches[1], caches[0]):
        torch.testing.assert_close(got.nan_to_num(7.0), want.nan_to_num(7.0), atol=2e-2, rtol=2e-2)
    assert len(declined) == (rotate_here and meta.num_decodes == meta.num_seqs)


def test_flash_attn_is_the_default_where_importable(flash_attn):
    """With flash_attn importable, CUDA defaults to it with 256-token blocks in fp16/bf16; a smaller block size or
    fp32 falls back to triton (logged), and naming flash_attn with either is an error that names the fix."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert default_block_size("cuda", None, bf16) == 256 and default_block_size("cuda", "triton", bf16) == 16
    assert default_block_size("cuda", None, fp32) == 16 and default_block_size("cpu", None, bf16) == 16
    assert get_attention_backend(None, "cuda", 2048, 256, bf16).name == "flash_attn"
    assert get_attention_backend(None, "cuda", 2048, 16, bf16).name == "triton"
    assert get_attention_backend(None, "cuda", 2048, 256, fp32).name == "triton"
    with pytest.raises(ValueError, match="block_size=256"):
        get_attention_backend("flash_attn", "cuda", 2048, 16, bf16)
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        get_attention_backend("flash_attn", "cuda", 2048, 256, fp32)
    with pytest.raises(ValueError, match="device='cuda'"):
        get_attention_backend("flash_attn", "cpu", 2048, 256, bf16)


def test_flash_attn_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    flash_attn_backend.flash_attn_available.cache_clear()
    try:
        assert default_block_size("cuda", None, torch.bfloat16) == 16
        with pytest.raises(ValueError, match="flash_attn package"):
            get_attention_backend("flash_attn", "cuda", 2048, 256, torch.bfloat16)
    finally:
        flash_attn_backend.flash_attn_available.cache_clear()
