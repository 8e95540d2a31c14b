"""Greedy tokens and logprobs of tiny random-weight Llama / Qwen2 / Qwen3 against HF transformers."""
import math

import pytest
import torch
from helpers import hf_greedy, hf_prompt_logprobs
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 80, (n,), generator=g)]


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_greedy_matches_hf(tiny_model_dir, shape):
    path = tiny_model_dir(shape)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    prompts = _prompts(6, 512)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=3, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, step_logprobs = hf_greedy(hf, prompt, 24)
        assert out.outputs[0].token_ids == tokens
        for entry, ref, token in zip(out.outputs[0].logprobs, step_logprobs, tokens):
            assert abs(entry[token].logprob - ref[token].item()) < 1e-4
            assert entry[token].rank == int((ref > ref[token]).sum()) + 1  # EOS, banned by min_tokens, may be above
        ref_prompt = hf_prompt_logprobs(hf, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            token = prompt[pos + 1]
            assert abs(entry[token].logprob - ref_prompt[pos, token].item()) < 1e-4
            top = ref_prompt[pos].topk(2).indices.tolist()
            assert all(t in entry for t in top)


def test_llama3_rope_scaling_is_used(tiny_model_dir):
    """tiny-llama has llama3 rope scaling; positions past the original context must still match HF."""
    path = tiny_model_dir("tiny-llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    prompt = _prompts(1, 512, seed=3)[0] * 4  # past original_max_position_embeddings = 128
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, min_tokens=16),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16)[0]


def test_sharded_safetensors_load_like_one_file(tiny_model_dir, tmp_path):
    from nanovllm.weights.synthetic import write_model

    sharded = write_model("tiny-qwen2", tmp_path / "sharded", torch.float32, device="cpu", shard_bytes=40_000)
    assert len(list(sharded.glob("*.safetensors"))) > 3
    prompt = {"prompt_token_ids": _prompts(1, 512, seed=5)[0]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(tiny_model_dir("tiny-qwen2"), max_model_len=256, kv_cache_memory_bytes=16 << 20)
    many = LLM(str(sharded), max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert one.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        many.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])
def test_dummy_weights_are_the_ones_the_writer_writes(tiny_model_dir, tmp_path, shape):
    """load_format="dummy" reads config.json alone and draws the weights at load: the values write_model writes
    with the same seed and device, so the tokens and logprobs are the written model's."""
    from nanovllm.weights.synthetic import write_config

    config_only, _ = write_config(shape, tmp_path / shape, torch.float32)
    assert not list(config_only.glob("*.safetensors"))
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, 512, seed=7)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    kw = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20)
    written = LLM(tiny_model_dir(shape), **kw).generate(prompts, params, use_tqdm=False)
    drawn = LLM(str(config_only), load_format="dummy", **kw).generate(prompts, params, use_tqdm=False)
    for a, b in zip(written, drawn):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.keys() for lp in a.outputs[0].logprobs] == [lp.keys() for lp in b.outputs[0].logprobs]


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])  # tied embedding, untied
def test_weight_bytes_per_step_count_each_weight_a_step_reads(tiny_model_dir, shape):
    """The benchmarks' bounds: the tied LM head once; an untied input embedding not at all (a step reads rows)."""
    from nanovllm.utils.benchmarking import weight_bytes_per_step
    from nanovllm.weights.synthetic import _BASE, SHAPES, weight_shapes

    config = {**_BASE, **SHAPES[shape]}
    elements = sum(math.prod(s) for s in weight_shapes(config).values())
    if not config["tie_word_embeddings"]:
        elements -= config["vocab_size"] * config["hidden_size"]
    llm = LLM(tiny_model_dir(shape), max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert weight_bytes_per_step(llm.llm_engine.model_runner.model) == 4 * elements  # fp32
