"""LLM(data_parallel_size=N) without Ray (distributed/data_parallel.py): on CPU two engine processes give every
request the output one engine gives, in input order; bad prompts fail before any replica starts; a dead replica
fails the call with its number."""
import random

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.distributed.data_parallel import deal

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 8 + i + 7 * (i % 5)))} for i in range(11)]
PARAMS = [SamplingParams(temperature=0, max_tokens=3 + i % 4, ignore_eos=True) for i in range(11)]


@pytest.fixture(scope="module")
def two_replicas(tiny_model_dir):
    llm = LLM(tiny_model_dir("tiny-llama"), data_parallel_size=2, **ENGINE)
    yield llm
    llm.replicas.close()


def test_two_replicas_give_one_engine_outputs_in_order(two_replicas, tiny_model_dir):
    want = LLM(tiny_model_dir("tiny-llama"), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    got = two_replicas.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in PROMPTS]
    assert len({o.request_id for o in got}) == len(got)
    chats = two_replicas.chat([[{"role": "user", "content": f"t{i} t{i + 1}"}] for i in range(3)],
                              SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [len(c.outputs[0].token_ids) for c in chats] == [4, 4, 4]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_deal_evens_out_both_prompt_and_output_tokens(size):
    # bench.py's workload: prompt and output lengths drawn apart. Dealing by prompt length alone gave one of two
    # replicas 6% more than half the output tokens (1.82x for 2 GPUs on the device, 2026-11-27)
    rng = random.Random(0)
    requests = [("", [1] * rng.randint(100, 1024), SamplingParams(max_tokens=rng.randint(100, 1024)))
                for _ in range(512)]
    shares = deal(requests, size)
    assert sorted(i for share in shares for i in share) == list(range(512))
    for total in (lambda r: len(r[1]), lambda r: r[2].max_tokens):
        sums = [sum(total(requests[i]) for i in share) for share in shares]
        assert max(sums) / (sum(sums) / size) < 1.01, sums


def test_a_bad_prompt_fails_before_any_replica_runs(two_replicas):
    with pytest.raises(ValueError, match="prompt 1:"):
        two_replicas.generate([PROMPTS[0], {"prompt_token_ids": [10**6]}], use_tqdm=False)
    assert len(two_replicas.generate(PROMPTS[:3], PARAMS[:3], use_tqdm=False)) == 3  # still serving


def test_a_dead_replica_fails_the_call_with_its_number(tiny_model_dir):
    llm = LLM(tiny_model_dir("tiny-llama"), data_parallel_size=2, **ENGINE)
    llm.replicas.processes[0].kill()
    llm.replicas.processes[0].join()
    with pytest.raises(RuntimeError, match="replica 1 died"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.replicas.close()


def test_two_replicas_of_two_tensor_parallel_ranks_give_one_engine_outputs(tiny_model_dir):
    """Four processes: each replica's engine leads a rank of its own."""
    want = LLM(tiny_model_dir("tiny-llama"), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(tiny_model_dir("tiny-llama"), data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    llm.replicas.close()
    llm.llm_engine.workers.close()


@pytest.mark.parametrize("kwargs,message", [
    (dict(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
])
def test_bad_data_parallel_settings_name_the_problem(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir("tiny-llama"), **kwargs, **ENGINE)
