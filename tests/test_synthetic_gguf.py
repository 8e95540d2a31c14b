"""Random-weight GGUF files in every block type load as models: each weight matrix has mean 0 and the std asked
for (bytes drawn on the GPU where there is one), and an engine generates from them. The tokenizer comes from the
bundled model (slow: it may be fetched)."""
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.quant.gguf_formats import FORMATS, dequantize
from nanovllm.weights.random_blocks import random_blocks
from nanovllm.weights.synthetic_gguf import write_gguf

SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=0, hidden_size=256,
             intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, rope_theta=10000.0)
HYBRID = dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", vocab_size=0, hidden_size=64,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
              num_experts=6, num_experts_per_tok=2, max_position_embeddings=1024,
              rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_random_blocks_have_the_asked_mean_and_std(type_name):
    raw = random_blocks(type_name, 64, 512, 0.05, np.random.default_rng(1))
    values = dequantize(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), type_name, 512)
    assert abs(values.mean().item()) < 0.01 and values.std().item() == pytest.approx(0.05, rel=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_a_synthetic_gguf_loads_and_generates(tmp_path, type_name):
    path = write_gguf(SMALL, type_name, str(tmp_path / f"small-{type_name}.gguf"))
    llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.model_config.vocab_size == 49152  # the donor's vocabulary
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_shape_whose_rows_are_not_whole_blocks_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Q4_K rows are whole blocks of 256 weights; this shape has rows of \[64"):
        write_gguf(dict(SMALL, hidden_size=64, intermediate_size=128), "Q4_K", str(tmp_path / "x.gguf"))


@pytest.mark.slow
def test_a_synthetic_qwen3_5_moe_gguf_keeps_its_experts_in_blocks(tmp_path):
    """A qwen35moe file (Gated DeltaNet and gated attention layers, experts beside a shared expert): loaded with its
    experts in their blocks it gives the tokens of the same file dequantized at load."""
    path = write_gguf(HYBRID, "Q8_0", str(tmp_path / "hybrid-q8_0.gguf"))
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["Hello", "The capital of France is"]
    kept = LLM(str(path), quantization="gguf", **kw)
    model = kept.llm_engine.model_runner.model
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and len(model.model.layers) == 4
    assert {part.type_name for layer in model.model.layers
            for part in layer.mlp.experts.quantized.parts.values()} == {"Q8_0"}
    got = [o.outputs[0].token_ids for o in kept.generate(prompts, params, use_tqdm=False)]
    del kept, model
    dense = LLM(str(path), **kw)
    assert got == [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_a_hybrid_gguf_tokenizer_reads_through_an_alias_where_transformers_lacks_its_architecture(tmp_path):
    """transformers before 5.2x refuses qwen35moe GGUF files; their tokenizer.* metadata read as qwen3's is the same
    tokenizer."""
    from transformers import AutoTokenizer

    from nanovllm.weights.model_files import _tokenizer_through_alias

    path = write_gguf(HYBRID, "Q8_0", str(tmp_path / "hybrid.gguf"))
    direct = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="hybrid.gguf")
    aliased = _tokenizer_through_alias(str(path), tmp_path / "cache")
    text = "Hello, world! The capital of France is Paris. 12345 éà"
    assert aliased(text).input_ids == direct(text).input_ids and len(aliased) == len(direct)
