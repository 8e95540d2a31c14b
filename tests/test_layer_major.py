"""A prompt that outgrows the device's KV blocks, running alone, is prefilled a layer at a time with its KV going
straight to the host pool (kvcache/layer_major.py): the greedy tokens and logprobs of a device that holds
everything, whether the prompt starts fresh or after a first chunk computed on the device, and no block leaks."""
import pytest
import torch
from conftest import assert_no_leaks

from nanovllm import LLM, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = {"prompt_token_ids": [(7 * j) % 500 + 3 for j in range(300)]}


@pytest.mark.parametrize("first_chunk_on_device", [False, True])
def test_a_prompt_prefilled_a_layer_at_a_time_gives_the_resident_tokens(tiny_model_dir, first_chunk_on_device):
    """6 device blocks of 16 tokens for a 300-token prompt, in chunks of 64 inside each layer. With a first chunk
    computed on the device (the scheduler declines the layer-major path once), its 4 blocks move to the pool and
    each layer loads them into its staging buffer."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(device=DEVICE, dtype="float32", max_model_len=512, block_size=16, max_num_batched_tokens=64,
              max_num_seqs=4)
    resident = LLM(tiny_model_dir("tiny-llama"), num_gpu_blocks_override=64, **kw)
    offloaded = LLM(tiny_model_dir("tiny-llama"), num_gpu_blocks_override=6, kv_offloading_size=0.01, **kw)
    scheduler = offloaded.llm_engine.scheduler
    if first_chunk_on_device:
        schedule = scheduler.schedule

        def first_chunk_on_the_device():
            scheduler.prefill_to_host = bool(scheduler.running)
            return schedule()

        scheduler.schedule = first_chunk_on_the_device
    want = resident.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    got = offloaded.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-4, abs=1e-4)
    assert offloaded.llm_engine.model_runner.layer_major.runs == 1
    assert offloaded.llm_engine.block_manager.num_offloaded_blocks >= 300 // 16 - 6
    assert_no_leaks(offloaded)


def test_the_step_takes_the_whole_rest_of_the_prompt(tiny_model_dir):
    """One step for the 300 tokens, past max_num_batched_tokens, its leading blocks in the pool and its tail on the
    device."""
    llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", max_model_len=512, block_size=16, max_num_batched_tokens=64,
              max_num_seqs=4, num_gpu_blocks_override=6, kv_offloading_size=0.01)
    engine = llm.llm_engine
    engine.add_request("0", PROMPT["prompt_token_ids"], SamplingParams(max_tokens=1))
    [seq] = engine.scheduler.schedule().seqs
    assert seq.num_scheduled_tokens == 300
    assert len(seq.host_blocks) == 19 - 6 and seq.block_table[:13] == [-1] * 13 and -1 not in seq.block_table[13:]


@pytest.mark.parametrize("first_len, shared, device_hits, host_hits, layer_major_runs", [
    (300, 200, 0, 12, 2), (80, 80, 5, 0, 1), (300, 288, 4, 14, 1)])
def test_a_prompt_that_shares_a_cached_prefix_starts_from_it(tiny_model_dir, first_len, shared, device_hits,
                                                           host_hits, layer_major_runs):
    """A second prompt that starts with the first one's tokens. A long first prompt's pool blocks stayed cached there
    when it finished: the second takes them as its own leading KV, no copy, no recompute (12 blocks of 200 shared
    tokens). A short first prompt's 5 blocks are cached on the device: they are copied to the pool. Sharing 288
    tokens, the second finds the 14 blocks the first left in the pool, then 4 of the tail it kept on the device
    (after its 6 device blocks filled, one more went to the pool), which are copied. Each time the second is
    prefilled from there (a layer at a time, but for the last case: its 12 new tokens fit on the device and attend
    to the pool through the ring), with the tokens of a device that holds everything."""
    first = {"prompt_token_ids": PROMPT["prompt_token_ids"][:first_len]}
    second = {"prompt_token_ids": PROMPT["prompt_token_ids"][:shared] + [(11 * j) % 500 + 3 for j in range(300 - shared)]}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    kw = dict(device=DEVICE, dtype="float32", max_model_len=512, block_size=16, max_num_batched_tokens=64,
              max_num_seqs=4)
    runs = {}
    for name, blocks, pool in (("resident", 64, None), ("offloaded", 6, 0.01)):
        llm = LLM(tiny_model_dir("tiny-llama"), num_gpu_blocks_override=blocks, kv_offloading_size=pool, **kw)
        runs[name] = [llm.generate([p], params, use_tqdm=False)[0] for p in (first, second)]
    for got, want in zip(runs["offloaded"], runs["resident"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, rel=1e-4,
                                                                  abs=1e-4)
    bm = llm.llm_engine.block_manager
    assert runs["offloaded"][1].num_cached_tokens == 16 * (device_hits + host_hits)
    assert (bm.num_cache_hit_blocks - bm.num_host_hit_blocks, bm.num_host_hit_blocks) == (device_hits, host_hits)
    assert llm.llm_engine.model_runner.layer_major.runs == layer_major_runs
    assert_no_leaks(llm)


def test_aborted_before_or_after_its_prefill_leaks_no_block(tiny_model_dir):
    """Aborted once scheduled (the pool blocks taken, the step not yet run), or after the prefill and a few decode
    steps (its 13 pool blocks then stay cached there, and the same prompt again finds them)."""
    llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", max_model_len=512, block_size=16, max_num_batched_tokens=64,
              max_num_seqs=4, num_gpu_blocks_override=6, kv_offloading_size=0.01, async_scheduling=False)
    engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("scheduled", PROMPT["prompt_token_ids"], params)
    engine.scheduler.schedule()
    engine.abort_request("scheduled")
    assert_no_leaks(llm)
    engine.add_request("decoding", PROMPT["prompt_token_ids"], params)
    for _ in range(3):
        engine.step()
    engine.abort_request("decoding")
    assert_no_leaks(llm)
    assert engine.block_manager.num_host_hit_blocks == 0
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.block_manager.num_host_hit_blocks == 19 - 6
    assert_no_leaks(llm)


def test_two_processes_prefill_a_layer_at_a_time_as_one(tiny_model_dir):
    """Tensor parallel over gloo: every rank stages and stores its own heads' KV (the run is a led call)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_model_len=512, block_size=16, max_num_batched_tokens=64,
              max_num_seqs=4, num_gpu_blocks_override=6, kv_offloading_size=0.01)
    tokens = []
    for size in (1, 2):
        llm = LLM(tiny_model_dir("tiny-llama"), tensor_parallel_size=size, **kw)
        tokens.append(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.llm_engine.model_runner.layer_major.runs == 1
        if llm.llm_engine.workers is not None:
            llm.llm_engine.workers.close()
    assert tokens[0] == tokens[1]


def test_the_fast_chunk_attention_is_the_torch_one():
    """The Triton paged prefill over a staging buffer (under the interpreter on CPU) against the masked torch twin,
    for a prompt's second chunk after its first."""
    from nanovllm.kvcache.layer_major import LayerMajorPrefill

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 16
    cache = torch.zeros(2, 1, 8, block, kv_heads, dim, device=DEVICE)
    outs = []
    for fast in (False, True):
        prefill = LayerMajorPrefill(None, cache, cache.clone(), max_tokens=96, chunk_tokens=40, fast=fast)
        metas = prefill._chunk_metas(computed=16, num_tokens=70, host_blocks=[0], device=DEVICE)
        generator = torch.Generator().manual_seed(1)
        prefill.staging[0].fill_(float("nan"))  # slots past the context must never be read
        prefill.staging[0][:, :, :1] = torch.randn(2, 1, 1, block, kv_heads, dim, generator=generator)  # the prefix
        for (start, end), meta in metas:
            q, k, v = (torch.randn(end - start, h, dim, generator=generator).to(DEVICE)
                       for h in (heads, kv_heads, kv_heads))
            out = prefill.attend(0, q, k, v, meta, dim ** -0.5)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
