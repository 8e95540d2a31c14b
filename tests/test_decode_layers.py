"""The one-kernel bs=1 decode step (csrc/decode_layers.cu) against its twin, the same model's layers run kernel by
kernel, on one decode step over contexts that end inside, at and past the attention splits' boundaries."""
import os

import pytest
import torch

from nanovllm import LLM
from nanovllm.attention import AttentionMetadata
from nanovllm.weights.synthetic import SHAPES, write_model

pytestmark = pytest.mark.gpu

_SMALL = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=4096, hidden_size=256,
              intermediate_size=768, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=2048, rope_theta=1000000.0, tie_word_embeddings=False)
MODELS = {
    "small-qwen3": _SMALL,  # head_dim 64, 4 q heads a kv head, tiles of 16 / 32 / 64 rows
    "qwen3-0.6b-3-layers": {**SHAPES["qwen3-0.6b"], "num_hidden_layers": 3, "vocab_size": 4096},
    "qwen2-bias": {**_SMALL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "head_dim": 128,
                   "hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4},  # q/k/v biases, no norms
}
CONTEXTS = (1, 2, 63, 64, 65, 129, 700, 1024)


@pytest.fixture(scope="module", params=sorted(MODELS))
def runner(request, tmp_path_factory):
    os.environ["NANOVLLM_DECODE_LAYERS"] = "1"  # off by default (kernels/decode_layers.py says why)
    path = write_model(MODELS[request.param], tmp_path_factory.mktemp(request.param), torch.bfloat16)
    llm = LLM(str(path), device="cuda", dtype=torch.bfloat16, enforce_eager=True, max_num_seqs=1,
              max_model_len=1024, num_gpu_blocks_override=256, enable_prefix_caching=False)
    runner = llm.llm_engine.model_runner
    assert runner.model.model.decode_layers is not None, "the one-kernel path is off"
    del os.environ["NANOVLLM_DECODE_LAYERS"]
    yield runner
    del llm, runner
    torch.cuda.empty_cache()


def _decode_step(runner, context: int, seed: int):
    """One decode step's input: a random context of `context` tokens (the last one new) in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    page = runner.block_size
    blocks = torch.randperm(runner.num_blocks, generator=g)[:-(-context // page)].to(torch.int32)
    table = torch.zeros(1, 64, dtype=torch.int32)
    table[0, :blocks.numel()] = blocks
    last = context - 1
    slot = int(blocks[last // page]) * page + last % page
    i32, i64 = dict(dtype=torch.int32, device="cuda"), dict(dtype=torch.int64, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot], **i64), query_start_loc=torch.tensor([0, 1], **i32),
        seq_lens=torch.tensor([context], **i32), block_tables=table.to("cuda"), num_decodes=1, max_query_len=1,
        max_seq_len=context, query_start_loc_cpu=[0, 1], seq_lens_cpu=[context])
    token = torch.randint(0, runner.vocab_size, (1,), generator=g).to("cuda")
    return token, torch.tensor([last], **i64), meta


@torch.inference_mode()
def _run(runner, one_kernel: bool, token, position, meta) -> torch.Tensor:
    inner = runner.model.model
    kernel = inner.decode_layers
    inner.decode_layers = kernel if one_kernel else None
    try:
        return runner.model(token, position, meta).float()
    finally:
        inner.decode_layers = kernel


@pytest.mark.parametrize("context", CONTEXTS)
def test_one_kernel_step_matches_layers(runner, context):
    token, position, meta = _decode_step(runner, context, seed=context)
    torch.manual_seed(context)
    runner.kv_cache.normal_()
    cache = runner.kv_cache.clone()
    ref = _run(runner, False, token, position, meta)
    ref_cache = runner.kv_cache.clone()
    outs = []
    for _ in range(3):  # the same every time: nothing of a launch (counters, partials) leaks into the next
        runner.kv_cache.copy_(cache)
        outs.append(_run(runner, True, token, position, meta))
        torch.cuda.synchronize()
        assert int(runner.model.model.decode_layers.counters.abs().sum()) == 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    out = outs[0]
    cos = torch.nn.functional.cosine_similarity(out, ref).item()
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    print(f"context {context}: cosine {cos:.6f}, max |diff| / max |ref| {err:.4f}")
    assert cos > 0.999 and err < 0.05
    # the step's key and value went where the twin put them, rounded alike (up to the GEMV's summation order)
    written = (runner.kv_cache - ref_cache).abs().amax().item()
    assert written < 0.05 * ref_cache.abs().amax().item()
    changed = (ref_cache != cache).flatten(2).any(-1)  # [2, layers, blocks + 1]: only the new token's block
    assert int(changed.sum()) == 2 * len(runner.model.model.layers)
