"""Random-weight GGUF files in every block type load as models: each weight matrix has mean 0 and the std asked
for (bytes drawn on the GPU where there is one), and an engine generates from them. The tokenizer comes from the
bundled model (slow: it may be fetched)."""
import numpy as np
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.quant.gguf_formats import FORMATS, dequantize
from nanovllm.weights.synthetic_gguf import random_blocks, write_gguf

SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=0, hidden_size=256,
             intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, rope_theta=10000.0)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_random_blocks_have_the_asked_mean_and_std(type_name):
    raw = random_blocks(type_name, 64, 512, 0.05, np.random.default_rng(1))
    values = dequantize(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), type_name, 512)
    assert abs(values.mean().item()) < 0.01 and values.std().item() == pytest.approx(0.05, rel=0.15)


@pytest.mark.slow
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
