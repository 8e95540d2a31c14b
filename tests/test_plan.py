"""The execution plan (engine/plan.py): decided once, read by the runner, logged as one table. The KV cache specs
(kvcache/spec.py): the sizing and the allocator ask each layer kind's spec, so a layer that keeps a fixed-size state a
sequence (a fake second kind here) takes its slots out of the budget and gets its own tensors, with no branch in the
runner."""
import pytest
import torch
from torch import nn

from nanovllm import LLM, SamplingParams
from nanovllm.kvcache.spec import KVCacheSpec, PagedAttentionSpec, StateSpec


def test_block_and_slot_bytes():
    paged = PagedAttentionSpec(block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    state = StateSpec(shapes=((4, 3), (2, 8, 8)), dtype=torch.bfloat16)
    assert paged.page_bytes == 2 * 16 * 2 * 32 * 4 and state.slot_bytes == (12 + 128) * 2
    spec = KVCacheSpec((paged, state, paged))
    assert spec.block_bytes == 2 * paged.page_bytes and spec.slot_bytes == state.slot_bytes
    assert spec.num_blocks(100 * spec.block_bytes + 4 * spec.slot_bytes, max_num_seqs=4) == 100
    assert spec.num_blocks(10, max_num_seqs=4) == 0


class FakeStateLayer(nn.Module):
    """A second layer kind: a conv state and a state matrix a sequence."""
    SHAPES = ((8, 3), (4, 16, 16))

    def kv_cache_spec(self, block_size, dtype):
        return StateSpec(self.SHAPES, dtype)

    def bind_kv_cache(self, *states):
        self.states = states


def test_a_state_layer_takes_its_slots_from_the_kv_budget(tiny_model_dir, monkeypatch):
    from nanovllm.engine import model_loader, model_runner

    load = model_loader.load_model

    def load_with_a_state_layer(config, device):
        model, streamer = load(config, device)
        model.model.state_layer = FakeStateLayer()
        return model, streamer

    kw = dict(device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20, max_num_seqs=8)
    plain = LLM(tiny_model_dir("tiny-llama"), **kw)
    monkeypatch.setattr(model_runner, "load_model", load_with_a_state_layer)
    stateful = LLM(tiny_model_dir("tiny-llama"), **kw)
    runner = stateful.llm_engine.model_runner
    layer, spec = runner.model.model.state_layer, runner.kv_spec
    assert [type(s) for s in spec.layers].count(StateSpec) == 1
    assert runner.plan.kv.num_gpu_blocks == ((4 << 20) - 8 * spec.slot_bytes) // spec.block_bytes
    assert runner.plan.kv.num_gpu_blocks < plain.llm_engine.model_runner.plan.kv.num_gpu_blocks
    assert [tuple(t.shape) for t in layer.states] == [(8, 8, 3), (8, 4, 16, 16)]
    params = SamplingParams(temperature=0, max_tokens=4)
    assert stateful.generate(["t1 t2"], params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate(["t1 t2"], params, use_tqdm=False)[0].outputs[0].token_ids


def test_the_plan_is_logged_once_as_one_table(tiny_model_dir, caplog):
    with caplog.at_level("INFO", logger="nanovllm"):
        llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    plan = llm.llm_engine.model_runner.plan
    assert plan.graphs_off == "not on CUDA" and not plan.cuda_graphs and not plan.fast_kernels
    assert plan.kv.num_gpu_blocks == llm.llm_engine.block_manager.num_blocks
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert infos == [plan.table(128)], infos  # every other start-up line is DEBUG
    for row in ("dtype", "attention", "kernels", "linears", "CUDA graphs", "weights", "KV cache"):
        assert f"\n  {row} " in infos[0]
    with pytest.raises(Exception):  # frozen
        plan.dtype = torch.float16
