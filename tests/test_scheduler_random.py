"""Every admitted sequence finishes, or the engine says why it cannot. The scheduler under random load: random prompt
lengths, max_tokens and n, shared prefixes, aborts mid-run, on KV caches from a few device blocks up, with a host pool
(swap or recompute) and without, async scheduling on and off; and a hybrid model whose linear-attention layers keep a
state slot a running sequence. Every request that is not aborted finishes with the greedy fp32 tokens of an engine
with ample memory, no block of either tier leaks, and the steps stay within a bound (a spin would exceed it). Where no
step can make progress, a NoProgressError names the waiting sequences and what to change, and keeps the outputs
finished before it."""
import random

import pytest
from conftest import assert_no_leaks

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import NoProgressError, Scheduler
from nanovllm.engine.sequence import Sequence

MAX_MODEL_LEN = 96
BLOCK_SIZE = 8
VOCAB = 512
CASES_PER_ENGINE = 40

# (device blocks, host pool GiB, preemption_mode, async scheduling, prefix caching, max_num_seqs, max_num_batched_tokens)
ENGINES = [
    (12, None, None, True, True, 8, 64),  # the fewest blocks that hold max_model_len: recompute only
    (20, None, None, False, True, 4, 32),
    (3, 0.001, "swap", True, True, 8, 64),  # a few blocks: most KV offloaded or swapped
    (5, 0.001, "recompute", False, True, 8, 32),
    (8, 0.001, "swap", False, False, 8, 64),
    (16, 0.001, "swap", True, True, 3, 24),
]


def make_engine(model: str, blocks, pool, mode, async_scheduling, prefix_caching, max_seqs, max_tokens) -> LLM:
    return LLM(model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               num_gpu_blocks_override=blocks, kv_offloading_size=pool, preemption_mode=mode,
               async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching, max_num_seqs=max_seqs,
               max_num_batched_tokens=max_tokens)


def random_case(rng: random.Random, documents: list[list[int]]):
    """A few requests: (prompt ids, max_tokens, n); a prompt often starts with one of the shared documents."""
    requests = []
    for _ in range(rng.randint(1, 6)):
        max_tokens = rng.randint(1, 20)
        length = rng.randint(1, MAX_MODEL_LEN - max_tokens)
        prefix = rng.choice(documents)[:length] if rng.random() < 0.5 else []
        prompt = prefix + [rng.randrange(1, VOCAB) for _ in range(length - len(prefix))]
        requests.append((prompt, max_tokens, rng.choice((1, 1, 2, 3))))
    return requests


def run_case(llm: LLM, requests, rng: random.Random, abort_chance: float):
    """The requests through the engine step by step, some aborted at random. Returns [(request, its completions' token
    ids)] of the finished ones, and the number of steps."""
    engine, finished, steps = llm.llm_engine, {}, 0
    ids = [f"r{rng.getrandbits(48)}" for _ in requests]
    for rid, (prompt, max_tokens, n) in zip(ids, requests):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True))
    live = list(ids)
    while engine.has_work():
        for out in engine.step():
            finished[out.request_id] = [c.token_ids for c in out.outputs]
            live.remove(out.request_id)
        steps += 1
        if live and rng.random() < abort_chance:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    return [(request, finished[rid]) for rid, request in zip(ids, requests) if rid in finished], steps


@pytest.mark.parametrize("shape,settings", [("tiny-llama", s) for s in ENGINES] + [
    ("tiny-qwen3-next", (12, None, None, True, True, 8, 64)),  # linear attention: state slots, recompute only
    ("tiny-qwen3-next", (20, None, None, False, True, 3, 24)),
    ("tiny-qwen3-next", (4, 0.001, None, True, True, 8, 32)),  # and KV offloaded past the device
], ids=lambda s: s if isinstance(s, str) else f"blocks{s[0]}-pool{s[1]}-{s[2]}-async{s[3]}")
def test_random_load_finishes_with_the_tokens_of_ample_memory(tiny_model_dir, shape, settings):
    model = tiny_model_dir(shape)
    rng = random.Random(repr(settings))
    documents = [[rng.randrange(1, VOCAB) for _ in range(MAX_MODEL_LEN)] for _ in range(3)]
    cases = [random_case(rng, documents) for _ in range(CASES_PER_ENGINE)]
    prompts = sorted({tuple(prompt) for case in cases for prompt, _, _ in case})
    ample = make_engine(model, 512, None, None, False, False, 256, 4096)
    greedy = ample.generate([{"prompt_token_ids": list(p)} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - len(p), ignore_eos=True)
                             for p in prompts], use_tqdm=False)
    want = {p: out.outputs[0].token_ids for p, out in zip(prompts, greedy)}
    llm = make_engine(model, *settings)
    for i, case in enumerate(cases):
        aborts = i % 2 == 1
        done, steps = run_case(llm, case, rng, abort_chance=0.05 if aborts else 0)
        for (prompt, max_tokens, n), completions in done:
            assert completions == [want[tuple(prompt)][:max_tokens]] * n, f"case {i}: {len(prompt)} prompt tokens"
        assert aborts or len(done) == len(case)
        total = sum(n * (len(prompt) + max_tokens) for prompt, max_tokens, n in case)
        assert steps <= 2 * total + 16, f"case {i}: {steps} steps for {total} tokens"
        assert_no_leaks(llm)


def test_a_sequence_no_kv_cache_can_hold_is_an_error_not_a_spin():
    """4 device blocks of 16 tokens and no host pool for a 100-token prompt (Config refuses such a cache for
    max_model_len; the scheduler's own check stands behind it)."""
    scheduler = Scheduler(BlockManager(4, 16), max_num_seqs=8, max_num_batched_tokens=256)
    scheduler.add(Sequence("big", 0, list(range(100)), SamplingParams(), seed=0, arrival=0))
    with pytest.raises(NoProgressError, match=r"request 'big' \(completion 0\): 100 tokens, 7 blocks wait, none fits the "
                       r"KV cache \(GPU: 4 of 4 blocks of 16 tokens free\)\. Give the KV cache more room"):
        scheduler.schedule()


def test_preemptions_that_undo_each_other_raise_and_keep_what_finished(tiny_model_dir, monkeypatch):
    """A scheduler made to preempt whatever runs before every step: the long prompt's chunks are recomputed for
    ever (no prefix cache to keep them); the engine raises once the steps exceed four times its tokens, with the
    short prompt's output kept."""
    llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=2, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule

    def forgetful_schedule():
        while scheduler.running:
            scheduler._preempt(scheduler.running.pop())
        return schedule()

    monkeypatch.setattr(scheduler, "schedule", forgetful_schedule)
    prompts = [{"prompt_token_ids": [5] * 8}, {"prompt_token_ids": list(range(1, 41))}]
    with pytest.raises(NoProgressError, match="steps ran without sampling a token for any of 1 sequences") as error:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert [out.prompt_token_ids for out in error.value.finished] == [[5] * 8]
    monkeypatch.undo()
    assert_no_leaks(llm)  # the call's requests were aborted: the engine stays usable
    assert len(llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)) == 2
