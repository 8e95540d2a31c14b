"""Experts past the GPU (streaming/expert_offload.py): with cpu_offload_gb on a mixture of experts, the resident and
the streamed experts together give the tokens of the model held whole, the resident set follows the routing counts,
and the placement plan puts the budget in whole experts."""
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
    p = ExpertPlacement.plan(num_layers=48, num_experts=128, expert_bytes=9 << 20, offload_bytes=30 << 30)
    assert p.offloaded == 72 and p.resident == 56  # 30 GiB / (48 layers x 9 MiB) = 71.1 -> 72 a layer
    assert ExpertPlacement.plan(2, 5, 100, 10_000).resident == 0  # more than the experts hold: all of them


def test_disk_offload_of_experts_is_refused(tiny_model_dir):
    with pytest.raises(NotImplementedError, match="cpu_offload_gb"):
        LLM(tiny_model_dir("tiny-qwen3-moe"), device="cpu", max_model_len=128, disk_offload_gb=1e-5)


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
