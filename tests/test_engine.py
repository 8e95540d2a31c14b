"""Scheduler, block manager and engine behaviour on the tiny llama: prefix caching, preemption,
chunked prefill, ordering, and no leaked blocks."""
import pytest
import torch
from conftest import assert_no_leaks

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _token_prompts(n, seed=0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": list(prefix) + torch.randint(3, 512, (int(length),), generator=g).tolist()}
            for length in torch.randint(1, 60, (n,), generator=g)]


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_outputs_in_input_order(tiny_llm):
    prompts = _token_prompts(10)
    outs = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    alone = [tiny_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts[:3]]
    assert _tokens(outs[:3]) == _tokens(alone)
    assert_no_leaks(tiny_llm)


def test_prefix_caching_reuses_blocks_and_changes_nothing(tiny_model_dir):
    path = tiny_model_dir("tiny-llama")
    shared = list(range(3, 3 + 100))  # 6 full blocks of 16
    prompts = _token_prompts(6, seed=1, prefix=shared)
    cached = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True)
    plain = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 96 for o in rest)
    assert cached.llm_engine.block_manager.num_cache_hit_blocks >= 5 * 6
    assert _tokens(first + rest) == _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert plain.llm_engine.block_manager.num_cache_hit_blocks == 0
    # a prompt fully covered by the cache still recomputes its last token (it needs logits)
    again = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert _tokens(again) == _tokens(first) and again[0].num_cached_tokens > 0
    assert cached.reset_prefix_cache()
    hits = cached.llm_engine.block_manager.num_cache_hit_blocks
    after_reset = cached.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert after_reset[0].num_cached_tokens == 0 and _tokens(after_reset) == _tokens(first)
    assert cached.llm_engine.block_manager.num_cache_hit_blocks == hits
    block_aligned = {"prompt_token_ids": shared[:96]}
    cached.generate(block_aligned, GREEDY, use_tqdm=False)
    twice = cached.generate(block_aligned, GREEDY, use_tqdm=False)
    assert twice[0].num_cached_tokens == 80  # 96 tokens cached, but the last block is recomputed
    for llm in (cached, plain):
        assert_no_leaks(llm)


def test_reset_prefix_cache_refuses_while_blocks_are_held(tiny_model_dir):
    llm = LLM(tiny_model_dir("tiny-llama"), max_model_len=512, kv_cache_memory_bytes=32 << 20)
    engine = llm.llm_engine
    engine.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=4))
    engine.step()
    assert not llm.reset_prefix_cache() and engine.block_manager.cached  # the running prompt's blocks stay
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() and not engine.block_manager.cached
    assert_no_leaks(llm)


def test_preemption_gives_identical_outputs(tiny_model_dir):
    path = tiny_model_dir("tiny-llama")
    prompts = _token_prompts(12, seed=2)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=60, ignore_eos=True)
    # on CPU everywhere: identical tokens across batch compositions need kernels whose rounding does not depend on
    # the batch, which the CPU path's are and the GPU's are not (they pick their tiles by batch size)
    big = LLM(path, max_model_len=128, num_gpu_blocks_override=1000, device="cpu")
    small = LLM(path, max_model_len=128, num_gpu_blocks_override=12, device="cpu")  # 192 tokens for 12 sequences
    expected = _tokens(big.generate(prompts, params, use_tqdm=False))
    small.llm_engine.model_runner.kv_cache.fill_(float("nan"))  # unwritten slots must never be read
    assert _tokens(small.generate(prompts, params, use_tqdm=False)) == expected
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert big.llm_engine.scheduler.num_preemptions == 0
    assert_no_leaks(small)
    assert_no_leaks(big)


def test_chunked_prefill_gives_identical_outputs(tiny_model_dir):
    path = tiny_model_dir("tiny-llama")
    prompts = _token_prompts(6, seed=3, prefix=list(range(3, 200)))
    whole = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)
    chunked = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False,
                  max_num_batched_tokens=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    a, b = whole.generate(prompts, params, use_tqdm=False), chunked.generate(prompts, params, use_tqdm=False)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b):
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs) == len(x.prompt_token_ids)
        for ex, ey in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert ex.keys() == ey.keys()
            assert all(abs(ex[t].logprob - ey[t].logprob) < 1e-4 for t in ex)
    assert_no_leaks(chunked)


def test_max_model_len_ends_generation(tiny_model_dir):
    llm = LLM(tiny_model_dir("tiny-llama"), max_model_len=40, num_gpu_blocks_override=10)
    out = llm.generate({"prompt_token_ids": list(range(3, 33))}, SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_block_manager_frees_and_evicts_in_order():
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.sequence import Sequence

    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence("a", 0, list(range(10)), SamplingParams(), 0, 0)
    assert bm.allocate_slots(a, 10) and len(a.block_table) == 3
    b = Sequence("b", 0, list(range(7)), SamplingParams(), 0, 1)
    assert not bm.allocate_slots(b, 7) and b.block_table == []  # nothing taken on failure
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert len(bm.cached) == 2
    hits = bm.find_cached_blocks(b)
    assert hits.device_blocks == a.block_table[:1] and not hits.host_hashes  # b shares a's first block only
    bm.free(a)
    assert bm.num_free_blocks == 4
    assert bm.allocate_slots(b, 3, hits) and b.block_table[0] == hits.device_blocks[0]
    assert bm.blocks[hits.device_blocks[0]].ref_count == 1 and bm.num_free_blocks == 2



def test_async_scheduling_changes_nothing(tiny_model_dir):
    """Launching each decode step before the previous tokens are read gives the same outputs as stepping
    synchronously, for every way a sequence can end mid-pipeline (stop id, stop string, length, min_tokens),
    seeded sampling, logprobs, n > 1, penalties (which fall back to synchronous steps), and a cache small
    enough to preempt."""
    path = tiny_model_dir("tiny-llama")
    prompts = _token_prompts(10, seed=5)
    g = torch.Generator().manual_seed(3)
    params = []
    for i in range(len(prompts)):
        kind = i % 5
        params.append(SamplingParams(
            temperature=0 if kind == 0 else 0.9, seed=i, max_tokens=int(torch.randint(1, 40, (1,), generator=g)),
            ignore_eos=True, n=2 if kind == 1 else 1, logprobs=2 if kind == 2 else None,
            stop_token_ids=list(range(3, 200)) if kind == 3 else None, min_tokens=3 if kind == 3 else 0,
            stop=["a", "e"] if kind == 4 else None, presence_penalty=0.5 if i == 9 else 0.0))
    results = {}
    for async_scheduling in (False, True):
        for blocks in (1000, 14):
            llm = LLM(path, max_model_len=128, num_gpu_blocks_override=blocks, async_scheduling=async_scheduling,
                      device="cpu")  # batch-invariant rounding: see test_preemption_gives_identical_outputs
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[async_scheduling, blocks] = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                                   c.cumulative_logprob) for c in o.outputs] for o in outs]
            assert (llm.llm_engine.num_steps_ahead > 0) == async_scheduling
            assert_no_leaks(llm)
    assert results[True, 1000] == results[False, 1000]
    # the small cache preempts; launched ahead, a step may meet other batch-mates (a sequence that finishes
    # frees its blocks a step later), which moves logprobs at fp32 rounding and nothing else
    _assert_same_completions(results[True, 14], results[False, 14])
    assert [[c[:3] for c in o] for o in results[True, 14]] == [[c[:3] for c in o] for o in results[True, 1000]]


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_no_step_is_launched_ahead_past_the_last_token(tiny_model_dir, max_tokens):
    """A step launched ahead for sequences whose last token the step before samples would be thrown away (a whole
    offloaded decode step at a long context): one step a token, the prefill's included."""
    llm = LLM(tiny_model_dir("tiny-llama"), max_model_len=128, device="cpu", kv_cache_memory_bytes=16 << 20)
    launch = llm.llm_engine.model_runner.launch
    launched = []
    llm.llm_engine.model_runner.launch = lambda *a, **k: launched.append(1) or launch(*a, **k)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == max_tokens and len(launched) == max_tokens
    assert max_tokens == 1 or llm.llm_engine.num_steps_ahead > 0  # still pipelined before the end


def _assert_same_completions(a, b):
    assert [[c[:4] for c in o] for o in a] == [[c[:4] for c in o] for o in b]
    for x, y in zip(a, b):
        for cx, cy in zip(x, y):
            if cx[4] is None or cy[4] is None:  # no logprobs asked for: None on both sides
                assert cx[4] is cy[4]
            else:
                assert cx[4] == pytest.approx(cy[4], rel=1e-5, abs=1e-5)


def _record_launches(runner, record):
    launch = runner.launch

    def recording(seqs, block_copies=(), input_ids_from=None):
        record(seqs, input_ids_from)
        return launch(seqs, block_copies, input_ids_from)

    runner.launch = recording


def test_async_scheduling_pipelines_prompt_chunks(tiny_model_dir):
    """Steps that fill prompts in chunks beside decodes are launched ahead too (their decodes fed by the tokens
    still on the device), with the outputs of synchronous steps."""
    path = tiny_model_dir("tiny-llama")
    prompts = _token_prompts(7, seed=4, prefix=list(range(3, 120)))
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, logprobs=1)
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64,
                  max_num_seqs=4, async_scheduling=async_scheduling, device="cpu")  # batch-invariant rounding (above)
        mixed_ahead = []
        _record_launches(llm.llm_engine.model_runner, lambda seqs, ahead: mixed_ahead.append(
            ahead is not None and any(s.num_scheduled_tokens > 1 for s in seqs)))
        outs = llm.generate(prompts, params, use_tqdm=False)
        del llm.llm_engine.model_runner.launch  # the wrapper holds the runner
        results[async_scheduling] = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob)
                                      for c in o.outputs] for o in outs]
        assert any(mixed_ahead) == async_scheduling
        assert_no_leaks(llm)
    _assert_same_completions(results[True], results[False])


def test_steady_decode_continues_only_the_same_batch_and_sends_only_new_blocks():
    """The runner's steady decode (CUDA graphs with inputs left on the device) goes on only for the very same
    sequences in the same order, each decoding; it sends the block table entries the device lacks, once."""
    from nanovllm.engine.input_batch import SteadyDecode
    from nanovllm.engine.sequence import Sequence

    seqs = [Sequence(str(i), 0, [1, 2, 3], SamplingParams(), seed=i, arrival=i) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table, seq.num_scheduled_tokens = [10 * i, 10 * i + 1], 1
    steady = SteadyDecode(seqs, [len(s.block_table) for s in seqs], max_seq_len=0)
    assert steady.continues(list(seqs))
    assert not steady.continues(seqs[:2]) and not steady.continues(seqs[::-1])
    other = Sequence("3", 0, [1, 2, 3], SamplingParams(), seed=3, arrival=3)
    other.num_scheduled_tokens = 1
    assert not steady.continues([seqs[0], seqs[1], other])
    seqs[2].num_scheduled_tokens = 4  # a prompt chunk again (after a preemption): not a decode step
    assert not steady.continues(list(seqs))
    assert steady.new_blocks() == []
    seqs[0].block_table.append(7)
    seqs[2].block_table += [8, 9]
    assert steady.new_blocks() == [(0, 2, 7), (2, 2, 8), (2, 3, 9)]
    assert steady.new_blocks() == []


def test_a_batch_becomes_steady_once_its_min_tokens_are_met(tiny_llm):
    """Steady decode's eligibility is read from each full step's sampling tensors: a batch held back by min_tokens
    (stop ids banned) is not steady, and the first full step after every min_tokens is met is."""
    from nanovllm.engine.sequence import Sequence

    runner = tiny_llm.llm_engine.model_runner
    seq = Sequence("0", 0, [1, 2, 3], SamplingParams(min_tokens=2, temperature=0.7), seed=0, arrival=0)
    assert not runner.prepare_sampling([seq]).steady
    seq.append_token(5)
    assert not runner.prepare_sampling([seq]).steady
    seq.append_token(6)
    assert runner.prepare_sampling([seq]).steady
    seq.params = SamplingParams(logprobs=1)
    assert not runner.prepare_sampling([seq]).steady
