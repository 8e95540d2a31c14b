"""Rope scalings for contexts past a model's native length (yarn, dynamic NTK, linear, llama3) against HF
transformers' own frequency functions, and a tiny yarn model's greedy tokens against HF past its original context."""
import pytest
import torch
from helpers import hf_greedy
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import attention_factor, compute_inv_freq
from nanovllm.rope_scaling import rope_parameters, scaled_max_positions
from nanovllm.weights.synthetic import SHAPES, write_model

QWEN3_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)  # Qwen3's model card


def hf_config(scaling: dict, max_position: int = 40960) -> Qwen3Config:
    return Qwen3Config(hidden_size=1024, num_attention_heads=16, head_dim=128, max_position_embeddings=max_position,
                       rope_parameters={"rope_theta": 1e6, **scaling})


@pytest.mark.parametrize("scaling", [
    QWEN3_YARN,
    dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.8,
         beta_fast=24, beta_slow=2),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192, truncate=False),
    dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=40960, attention_factor=1.2),
    dict(rope_type="linear", factor=4.0),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),
])
def test_frequencies_and_scale_match_hf(scaling):
    config = hf_config(scaling)
    want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    p = rope_parameters(config)
    torch.testing.assert_close(compute_inv_freq(128, p, config.max_position_embeddings), want, rtol=1e-6, atol=0)
    assert attention_factor(p) == pytest.approx(want_scale, rel=1e-12)


def test_dynamic_ntk_is_hfs_at_the_scaled_length():
    """vLLM's static NTK: HF's dynamic frequencies for a sequence as long as the scaled context, at every length
    (HF recomputes them as a sequence grows, which a paged KV cache written at other lengths could not follow)."""
    config = hf_config(dict(rope_type="dynamic", factor=2.0), max_position=4096)
    p = rope_parameters(config)
    assert scaled_max_positions(p, 4096) == 8192
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=8192)
    torch.testing.assert_close(compute_inv_freq(128, p, 4096), want, rtol=1e-6, atol=0)


def test_scaled_context_is_the_default_max_model_len(tmp_path):
    shape = dict(SHAPES["tiny-qwen3"], max_position_embeddings=256,
                 rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256))
    path = write_model(shape, tmp_path / "m", torch.float32, device="cpu")
    llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.model_config.max_model_len == 1024
    with pytest.raises(ValueError, match=r"max_model_len \(2048\) is larger than the model's context \(1024"):
        LLM(str(path), device="cpu", max_model_len=2048)


@pytest.mark.parametrize("scaling", [dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64),
                                     dict(rope_type="linear", factor=4.0)])
def test_greedy_past_the_original_context_matches_hf(tmp_path, scaling):
    shape = dict(SHAPES["tiny-qwen3"], max_position_embeddings=128, rope_scaling=scaling)
    path = str(write_model(shape, tmp_path / "m", torch.float32, device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", kv_cache_memory_bytes=16 << 20)
    prompt = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(2)).tolist()  # past 128 and 64
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    tokens, step_logprobs = hf_greedy(hf, prompt, 12)
    assert out.token_ids == tokens
    for entry, ref, token in zip(out.logprobs, step_logprobs, tokens):
        assert abs(entry[token].logprob - ref[token].item()) < 1e-4
