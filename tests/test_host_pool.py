"""The host KV pool (kv_offloading_size). Swap preemption: a preempted sequence's KV copied to host blocks and back
gives the tokens that recomputing it gives, and the swap-or-recompute choice follows the measured costs. Prefix
cache: a block the device evicts keeps its KV in the pool, and a prompt that starts with it loads it back. No block
of either tier leaks through preemption, abort or completion."""
import random

import pytest
import torch
from conftest import assert_no_leaks

from nanovllm import LLM, SamplingParams
from nanovllm.kvcache.preemption import PreemptionPolicy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the pool is pinned and copies cross the link
PROMPTS = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def engine(tiny_model_dir, **kw) -> LLM:
    """12 device blocks of 16 tokens for 6 sequences of up to 95 tokens: preemptions are certain. With a host pool,
    preemption swaps unless the test pins it otherwise (the measured choice has its own test).
    fp32 on CUDA too: in bf16 a recomputed prefill's KV differs from the decode steps' in the last bits, and the tiny
    random model's near ties then break the other way (seen on the H100)."""
    if kw.get("kv_offloading_size"):
        kw.setdefault("preemption_mode", "swap")
    return LLM(tiny_model_dir("tiny-llama"), device=DEVICE, dtype="float32", max_model_len=128,
               num_gpu_blocks_override=12, block_size=16, **kw)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_swap_gives_the_tokens_of_recompute(tiny_model_dir):
    recompute, swap = engine(tiny_model_dir), engine(tiny_model_dir, kv_offloading_size=0.01)
    want, got = greedy(recompute), greedy(swap)
    assert recompute.llm_engine.scheduler.num_preemptions > 0 and recompute.llm_engine.scheduler.num_swaps == 0
    assert swap.llm_engine.scheduler.num_swaps > 0
    assert got == want
    assert_no_leaks(recompute)
    assert_no_leaks(swap)


def test_the_measured_policy_swaps_where_the_copy_costs_less():
    """64 KiB blocks, 1 GFLOP a token: at 10 GB/s a block's copy out and back takes 13 us; at 100 TFLOP/s a token's
    recompute 10 us."""
    policy = PreemptionPolicy(None, block_bytes=64 << 10, flops_per_token=1e9, link_bandwidth=10e9, flops=100e12)
    assert policy.swaps(1, 16) and not policy.swaps(1, 1)
    assert policy.swaps(10, 14) and not policy.swaps(10, 13)
    assert PreemptionPolicy("swap").swaps(1000, 1) and not PreemptionPolicy("recompute").swaps(1, 1000)


def test_recompute_where_pinned_or_the_pool_is_full(tiny_model_dir):
    want = greedy(engine(tiny_model_dir))
    llm = engine(tiny_model_dir, kv_offloading_size=0.01, preemption_mode="recompute")
    assert greedy(llm) == want and llm.llm_engine.scheduler.num_swaps == 0
    llm = engine(tiny_model_dir, kv_offloading_size=0.01)
    space = llm.llm_engine.scheduler.host_pool
    del space.free_blocks[1:]  # one host block: too few for any preempted sequence
    assert greedy(llm) == want and llm.llm_engine.scheduler.num_swaps == 0


def test_the_measured_choice_is_made_at_start_up(tiny_model_dir):
    policy = engine(tiny_model_dir, kv_offloading_size=0.01, preemption_mode=None).llm_engine.scheduler.preemption
    assert policy.mode is None and policy.link_bandwidth > 0 and policy.flops > 0 and policy.flops_per_token > 0


def test_no_block_leaks_through_random_aborts(tiny_model_dir):
    llm = engine(tiny_model_dir, kv_offloading_size=0.01)
    eng, rng = llm.llm_engine, random.Random(0)
    for round_ in range(3):
        ids = [f"r{round_}-{i}" for i in range(8)]
        for rid, prompt in zip(ids, PROMPTS + PROMPTS[:2]):
            eng.add_request(rid, prompt["prompt_token_ids"], SamplingParams(temperature=0.8, max_tokens=30, seed=1))
        for _ in range(40):
            eng.step()
            if rng.random() < 0.15:
                eng.abort_request(rng.choice(ids))
        eng.abort_request(ids)
        while eng.has_work():  # a step launched ahead drains
            eng.step()
        assert_no_leaks(llm)
    assert eng.scheduler.num_swaps > 0


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_pool(tiny_model_dir):
    shared = {"prompt_token_ids": list(range(100, 180))}  # 5 blocks, 4 of them reusable (the last token computes)
    others = [{"prompt_token_ids": list(range(200 + 50 * i, 250 + 50 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for size in (None, 0.01):
        llm = engine(tiny_model_dir, kv_offloading_size=size)
        first = llm.generate(shared, params, use_tqdm=False)[0]
        llm.generate(others, params, use_tqdm=False)  # 12 device blocks: the shared prefix is evicted
        again = llm.generate(shared, params, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        outputs[size] = (again.num_cached_tokens, llm.llm_engine.block_manager.num_host_hit_blocks)
        assert_no_leaks(llm)
    assert outputs[None] == (0, 0)  # without the pool the prefix is recomputed
    assert outputs[0.01] == (64, 4)
    assert llm.reset_prefix_cache() and not llm.llm_engine.scheduler.host_pool.cached


@pytest.mark.slow
def test_smollm2_swaps_as_it_recomputes(smollm2_path):
    """The real model (fp32 on CPU): 10 answers of ~64 tokens each on 24 blocks of 16 tokens."""
    prompts = [f"Question {i}: name a city in Europe and say why people visit it." for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for size in (None, 0.05):
        llm = LLM(smollm2_path, device=DEVICE, max_model_len=256, num_gpu_blocks_override=24, block_size=16,
                  kv_offloading_size=size, preemption_mode="swap" if size else None)
        runs[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_no_leaks(llm)
    assert llm.llm_engine.scheduler.num_swaps > 0
    assert runs[0.05] == runs[None]


@pytest.mark.slow
def test_smollm2_offloaded_together_answers_as_with_room(smollm2_path):
    """The real model (fp32 on CPU): 4 chat prompts padded past the device's 6 blocks of 16 tokens decode together
    with their leading blocks in the pool, finishing at different steps: the answers of a device with room."""
    text = "Here is a long note about European cities, their rivers, their bridges and their old markets. " * 3
    prompts = [[{"role": "user", "content": f"{text}Question {i}: name one of them."}] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 30, 20, 40)]
    runs = {}
    for blocks, size in ((64, None), (6, 0.05)):
        llm = LLM(smollm2_path, device=DEVICE, dtype="float32", max_model_len=512, num_gpu_blocks_override=blocks,
                  block_size=16, kv_offloading_size=size)
        ids = [llm.chat_prompt(p)["prompt_token_ids"] for p in prompts]
        outputs, together = run_counting_offloaded(llm, ids, params)
        runs[size] = [o.token_ids for o in outputs]
        assert_no_leaks(llm)
    assert together >= 2 and llm.llm_engine.scheduler.num_preemptions == 0
    assert runs[0.05] == runs[None]


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_offloading_size=0), "kv_offloading_size must be None or > 0"),
    (dict(kv_offloading_size=1e-9), "kv_offloading_size=1e-09 GiB holds no KV block"),
    (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "kv_offloading_backend must be None or 'native'"),
    (dict(preemption_mode="swap"), "preemption_mode='swap' copies KV to host memory: set kv_offloading_size"),
    (dict(preemption_mode="offload"), "preemption_mode must be None, 'swap' or 'recompute'"),
])
def test_bad_offloading_settings_name_the_problem(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine(tiny_model_dir, **kwargs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_context_beyond_the_device_blocks_runs_offloaded(tiny_model_dir, prefix_caching):
    """6 device blocks of 16 tokens (96) for prompts of 150-300 tokens: each sequence's leading blocks move to the
    host pool and are attended to from there; the greedy tokens are those of a device that holds everything."""
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 500 + 3 for j in range(n)]} for i, n in enumerate((300, 150, 220))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    kw = dict(device=DEVICE, dtype="float32", max_model_len=512, block_size=16, enable_prefix_caching=prefix_caching)
    runs = {}
    for blocks, size in ((64, None), (6, 0.01)):
        llm = LLM(tiny_model_dir("tiny-llama"), num_gpu_blocks_override=blocks, kv_offloading_size=size, **kw)
        runs[size] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.block_manager.num_offloaded_blocks >= 300 // 16 - 6
    for got, want in zip(runs[0.01], runs[None]):
        assert got.token_ids == want.token_ids
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, rel=1e-4, abs=1e-4)
    assert_no_leaks(llm)


def test_offloaded_sequences_decode_together(tiny_model_dir):
    """4 prompts of 150-300 tokens on 6 device blocks (96 tokens), finishing at different steps: they run in the same
    steps, two or more with leading blocks in the pool (not one at a time, the others preempted), with the tokens
    and logprobs of a device that holds everything; both tiers free after."""
    prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((300, 150, 220, 180))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (24, 9, 17, 30)]
    want, llm = roomy_outputs_and_tight_llm(tiny_model_dir, prompts, params)
    got, together = run_counting_offloaded(llm, prompts, params)
    assert together >= 2 and llm.llm_engine.scheduler.num_preemptions == 0
    assert_same_completions(got, want)
    assert_no_leaks(llm)


def roomy_outputs_and_tight_llm(tiny_model_dir, prompts: list[list[int]], params: list[SamplingParams]):
    """The completions of a device that holds everything (fp32), and an engine of 6 device blocks and a host pool."""
    kw = dict(device=DEVICE, dtype="float32", max_model_len=512, block_size=16)
    roomy = LLM(tiny_model_dir("tiny-llama"), num_gpu_blocks_override=128, **kw)
    want = [o.outputs[0] for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    return want, LLM(tiny_model_dir("tiny-llama"), num_gpu_blocks_override=6, kv_offloading_size=0.01, **kw)


def assert_same_completions(got: list, want: list):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, rel=1e-4, abs=1e-4)


def run_counting_offloaded(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, int]:
    """Each prompt's first completion, stepping the engine, and the most running sequences a step had with blocks
    in the host pool."""
    engine, got, together = llm.llm_engine, {}, 0
    for i, (prompt, sampling) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sampling)
    while engine.has_work():
        together = max(together, sum(bool(s.host_blocks) for s in engine.scheduler.running))
        got.update((out.request_id, out.outputs[0]) for out in engine.step())
    return [got[str(i)] for i in range(len(prompts))], together


def test_without_a_host_pool_the_device_must_hold_max_model_len(tiny_model_dir):
    with pytest.raises(ValueError, match="fewer than max_model_len=512"):
        LLM(tiny_model_dir("tiny-llama"), device=DEVICE, max_model_len=512, block_size=16, num_gpu_blocks_override=6)


def test_offloaded_blocks_stay_ascending_runs_after_the_pool_is_reused():
    """sgDMA copies a run of consecutive pool blocks in one call: a sequence offloaded in pieces, one released and
    the next offloaded again, gets ascending runs each time (released blocks once came back descending)."""
    from nanovllm.kvcache.host_pool import HostKVPool

    pool = HostKVPool(torch.zeros(2, 1, 8, 4, 1, 2), 16)
    for _ in range(3):
        taken = pool.swap_out(list(range(6))) + pool.swap_out([6]) + pool.swap_out([7])
        assert taken == list(range(taken[0], taken[0] + 8)), taken
        pool.release(taken)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_offloaded_decode_stays_with_the_resident_run(tmp_path):
    """bf16 on the device, a random model with real heads of 128: the offloaded run (a layer-major prefill, then the
    ring's Triton decode and fused merge) against the resident one. The parts merge in another order, so bf16 rounds
    otherwise and a near tie may flip a later token: the first token's logprob agrees closely whatever is chosen, and
    the agreement of the greedy tokens is printed, as TP's bf16 test does, and must be the norm, not the exception."""
    from nanovllm.weights.synthetic import SHAPES, write_model

    shape = dict(SHAPES["tiny-llama-128"], hidden_size=512, intermediate_size=1024, num_hidden_layers=4)
    path = str(write_model(shape, str(tmp_path), torch.bfloat16, device="cuda"))
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 500 + 3 for j in range(n)]} for i, n in enumerate((600, 300, 450))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=1024, block_size=16, kv_cache_memory_bytes=64 << 20)
    runs = {}
    for blocks, size in ((None, None), (8, 0.05)):
        llm = LLM(path, num_gpu_blocks_override=blocks, kv_offloading_size=size, **kw)
        runs[size] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.block_manager.num_offloaded_blocks >= 600 // 16 - 8
    assert_no_leaks(llm)
    for got, want in zip(runs[0.05], runs[None]):
        first_got, first_want = got.logprobs[0], want.logprobs[0]
        assert max(first_got.values(), key=lambda p: p.logprob).logprob == pytest.approx(
            max(first_want.values(), key=lambda p: p.logprob).logprob, abs=0.05)
    pairs = [(a, b) for got, want in zip(runs[0.05], runs[None]) for a, b in zip(got.token_ids, want.token_ids)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"bf16 offloaded vs resident greedy token agreement: {agreement:.1%}")
    assert agreement >= 0.5


def test_block_copies_run_in_the_order_decided():
    """The step's copy list: consecutive copies one way merge into one call, except where a block would be written
    twice in it; the list run on the caches equals each copy run alone, in order (a plain indexed copy)."""
    from nanovllm.kvcache.block_copy import IN, OUT, queue_copy, run_block_copies

    copies = []
    queue_copy(copies, OUT, [1, 2], [10, 11])
    queue_copy(copies, OUT, [3], [12])
    queue_copy(copies, OUT, [4], [10])  # pool block 10 again: its own call, after the first
    queue_copy(copies, IN, [10, 12], [1, 6])
    assert [(c.direction, c.src, c.dst) for c in copies] == [
        (OUT, [1, 2, 3], [10, 11, 12]), (OUT, [4], [10]), (IN, [10, 12], [1, 6])]
    kv_cache, pool = torch.randn(2, 3, 8, 4, 1, 2), torch.randn(2, 3, 16, 4, 1, 2)
    want_cache, want_pool = kv_cache.clone(), pool.clone()
    for direction, src, dst in [(OUT, 1, 10), (OUT, 2, 11), (OUT, 3, 12), (OUT, 4, 10), (IN, 10, 1), (IN, 12, 6)]:
        source, target = (want_cache, want_pool) if direction == OUT else (want_pool, want_cache)
        target[:, :, dst] = source[:, :, src]
    run_block_copies(copies, kv_cache, pool)
    assert torch.equal(kv_cache, want_cache) and torch.equal(pool, want_pool)


def test_long_prompts_prefill_a_layer_at_a_time_between_the_others_decode_steps(tiny_model_dir):
    """4 prompts each longer than the device's 6 blocks: each prefills a layer at a time in a step of its own (not in
    chunks that would stream its prefix once a chunk), the running ones decoding in the steps between; the tokens and
    logprobs of a device that holds everything, both tiers free after."""
    prompts = [[(5 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((200, 260, 140, 230))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (20, 6, 14, 25)]
    want, llm = roomy_outputs_and_tight_llm(tiny_model_dir, prompts, params)
    engine, scheduler = llm.llm_engine, llm.llm_engine.scheduler
    schedule, beside = scheduler.schedule, []

    def watched():
        running = len(scheduler.running)
        out = schedule()
        if scheduler.last_step_alone:
            beside.append(running)  # the sequences that waited a step for it
        return out

    scheduler.schedule = watched
    got, _ = run_counting_offloaded(llm, prompts, params)
    assert engine.model_runner.layer_major.runs == 4 and len(beside) == 3 and min(beside) >= 1
    assert_same_completions(got, want)
    assert_no_leaks(llm)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_failed_copy_of_offloaded_blocks_is_an_error_not_a_hang(tiny_model_dir, monkeypatch, device):
    """A copy between the pool and the ring that fails (as sgDMA reports one) ends generate() with that error, at
    once: no step waits on a slot that will never load."""
    import time

    import nanovllm.kvcache.offload_engine as offload_engine

    def failing_copy(*args):
        raise RuntimeError("sgdma: the copy failed (injected)")

    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(200)]} for i in range(2)]
    llm = LLM(tiny_model_dir("tiny-llama"), device=device, dtype="float32", max_model_len=512, block_size=16,
              num_gpu_blocks_override=6, kv_offloading_size=0.01)
    monkeypatch.setattr(offload_engine, "copy_blocks", failing_copy)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the copy failed"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 60
