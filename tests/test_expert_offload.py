"""Experts past the GPU (streaming/expert_offload.py): with cpu_offload_gb on a mixture of experts, the resident and
the streamed experts together give the tokens of the model held whole, the resident set follows the routing counts,
and the placement plan puts the budget in whole experts."""
import gc

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.streaming.expert_offload import ExpertOffload, ExpertPlacement

PROMPTS = [{"prompt_token_ids": [3 + (7 * i + j) % 500 for j in range(n)]} for i, n in enumerate((5, 33, 60))]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("shape,moe_layers", [("tiny-qwen3-moe", 2), ("tiny-qwen3-next", 3)])
@pytest.mark.parametrize("revise_every", [1000, 3])
def test_streamed_experts_give_the_resident_tokens(tiny_model_dir, monkeypatch, shape, moe_layers, revise_every):
    """3 of 5 experts a layer in host memory (the budget in whole experts), loaded when routed; revising the
    resident set every 3 forwards of a layer moves experts between the tiers mid-run."""
    import nanovllm.streaming.expert_offload as expert_offload

    monkeypatch.setattr(expert_offload, "REVISE_EVERY", revise_every)
    path = tiny_model_dir(shape)
    kw = dict(device="cpu", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    want = _tokens(LLM(path, **kw))
    llm = LLM(path, cpu_offload_gb=3 * moe_layers * 24_576 / (1 << 30), **kw)  # 24 KiB experts: 3 a layer
    offload = llm.llm_engine.model_runner.streamer
    assert isinstance(offload, ExpertOffload)
    assert (offload.placement.resident, offload.placement.offloaded) == (2, 3)
    assert "2 of 5 experts a layer" in llm.llm_engine.model_runner.plan.table(128)
    assert _tokens(llm) == want
    assert offload.num_loaded > 0
    moved = [layer.resident != [0, 1] for layer in offload.layers]
    assert any(moved) == (revise_every == 3)


def test_the_placement_puts_the_budget_in_whole_experts():
    p = ExpertPlacement.plan(num_layers=48, num_experts=128, expert_bytes=9 << 20, host_bytes=30 << 30)
    assert p.host == 72 and p.resident == 56  # 30 GiB / (48 layers x 9 MiB) = 71.1 -> 72 a layer
    assert "42.5 MB a layer, 2.04 GB a token" in p.table(top_k=8)  # 8 x 72 / 128 of 9 MiB, 48 layers
    assert ExpertPlacement.plan(2, 5, 100, 10_000).resident == 0  # more than the experts hold: all of them
    both = ExpertPlacement.plan(48, 128, 9 << 20, host_bytes=10 << 30, disk_bytes=20 << 30)
    assert (both.disk, both.host, both.resident) == (48, 24, 56)


def test_experts_on_disk_give_the_resident_tokens(tiny_model_dir, tmp_path):
    """2 experts a layer in host memory and 2 on disk (each projection at its own aligned offset of a file in
    offload_folder, read back when routed): the resident tokens; the file goes with the engine."""
    path = tiny_model_dir("tiny-qwen3-moe")
    kw = dict(device="cpu", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    want = _tokens(LLM(path, **kw))
    per_layer = 2 * 24_576 / (1 << 30)
    llm = LLM(path, cpu_offload_gb=2 * per_layer, disk_offload_gb=2 * per_layer, offload_folder=str(tmp_path), **kw)
    offload = llm.llm_engine.model_runner.streamer
    assert (offload.placement.resident, offload.placement.host, offload.placement.disk) == (1, 2, 2)
    assert "2 on disk" in llm.llm_engine.model_runner.plan.table(128)
    assert _tokens(llm) == want
    [file] = tmp_path.glob("nanovllm-layers-*.bin")
    del llm, offload
    gc.collect()
    assert not file.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape,moe_layers", [("tiny-qwen3-moe", 2), ("tiny-qwen3-next", 3)])
def test_streamed_experts_on_the_gpu_give_the_resident_tokens(tiny_model_dir, shape, moe_layers):
    """fp32 on CUDA: pinned host experts gathered into the device pool, the fused kernels leaving out the pairs of
    the other tier."""
    path = tiny_model_dir(shape)
    kw = dict(device="cuda", dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    want = _tokens(LLM(path, **kw))
    llm = LLM(path, cpu_offload_gb=3 * moe_layers * 24_576 / (1 << 30), **kw)
    assert _tokens(llm) == want
    assert llm.llm_engine.model_runner.streamer.num_loaded > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_q4_k_experts_stream_as_their_blocks_on_the_gpu(tmp_path):
    """A qwen3moe file of Q4_K experts in fp32: 5 of 8 a layer in pinned host memory, gathered as blocks into the
    device pool for the fused Q4_K kernel: the tokens of the run that holds them all."""
    import os

    from nanovllm.weights.synthetic_gguf import write_gguf

    shape = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=0, hidden_size=256,
                 intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024, rope_theta=1e6)
    path = str(write_gguf(shape, "Q4_K", str(tmp_path / "moe-q4_k.gguf"), os.environ.get("NANOVLLM_TOKENIZER_GGUF")))
    kw = dict(device="cuda", dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    want = _tokens(LLM(path, **kw))
    expert = 3 * 256 * 144  # gate, up and down: 256 rows of one 144-byte Q4_K block each
    llm = LLM(path, cpu_offload_gb=5 * 2 * expert / (1 << 30), **kw)
    offload = llm.llm_engine.model_runner.streamer
    assert offload.placement.resident == 3 and torch.uint8 in {t.dtype for t in offload.pool.stacks.values()}
    assert _tokens(llm) == want
    assert offload.num_loaded > 0


@pytest.mark.parametrize("shape,offloaded", [("tiny-qwen3-moe", 3), ("tiny-qwen3.5-moe", 3), ("tiny-qwen3-moe", 5)])
def test_dummy_experts_in_blocks_stream_as_the_held_ones_run(tiny_model_dir, shape, offloaded):
    """load_format="dummy" with quantization="gguf": every layer's experts drawn as random blocks (Q8_0 at these
    widths) and kept as them; streamed past the device (some, or all of a layer's) they give the tokens of the run
    that holds them all."""
    from nanovllm.weights.synthetic import write_config

    path = str(write_config(shape, tiny_model_dir(shape) + "-config")[0])
    kw = dict(device="cpu", load_format="dummy", quantization="gguf", max_model_len=128,
              kv_cache_memory_bytes=16 << 20)
    held = LLM(path, **kw)
    blocks = [m.experts.quantized for m in held.llm_engine.model_runner.model.modules() if hasattr(m, "experts")
              and getattr(m.experts, "quantized", None) is not None]
    assert blocks and {p.type_name for b in blocks for p in b.parts.values()} == {"Q8_0"}
    want = _tokens(held)
    per_expert = sum(t[0].numel() * t.element_size() for t in blocks[0].stacks().values())
    llm = LLM(path, cpu_offload_gb=offloaded * len(blocks) * per_expert / (1 << 30), **kw)
    offload = llm.llm_engine.model_runner.streamer
    assert offload.placement.offloaded == offloaded and _tokens(llm) == want and offload.num_loaded > 0


def test_dummy_experts_are_q4_k_at_real_widths():
    from types import SimpleNamespace

    from nanovllm.quant.gguf_formats import dequantize
    from nanovllm.weights.model_files import dummy_experts_type
    from nanovllm.weights.synthetic import random_weights

    assert dummy_experts_type(SimpleNamespace(hidden_size=2048, moe_intermediate_size=768)) == "Q4_K"
    config = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=256, intermediate_size=256,
                  moe_intermediate_size=512, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=128, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    weights = dict(random_weights(config, torch.float32, "cpu", experts_type="Q4_K"))
    down = weights["model.layers.0.mlp.experts.down_proj"]
    assert down.type_name == "Q4_K" and down.shape == (4 * 256, 512)
    values = dequantize(down.to_blocks(), "Q4_K", 512)
    assert abs(values.mean().item()) < 0.01 and values.std().item() == pytest.approx(512 ** -0.5, rel=0.15)
    assert not any(".experts.0." in name for name in weights)
