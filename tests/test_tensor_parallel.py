"""Tensor parallelism (distributed/): on CPU two processes over gloo split the heads, the MLP rows and the
vocabulary, and give the greedy tokens and logprobs of one process; bad sizes are refused before any weight loads; a
worker that dies fails the job with its rank."""
import ctypes
import gc
import threading
import time

import pytest
import torch

from nanovllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(3 + i, 30 + 5 * i))} for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def run(model: str, inspect=None, **kw):
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20, **kw)
    runner, size = llm.llm_engine.model_runner, kw.get("tensor_parallel_size", 1)
    heads = runner.hf_config.num_attention_heads
    assert runner.attention_layers[0].num_heads == heads // size  # rank 0 holds its share of the heads
    assert runner.model.lm_head.output_size == runner.hf_config.vocab_size // size
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    if inspect is not None:
        inspect(llm.llm_engine)
    if llm.llm_engine.workers is not None:
        llm.llm_engine.workers.close()
    return outputs


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_two_cpu_processes_give_the_tokens_of_one(tiny_model_dir, shape):
    one, two = run(tiny_model_dir(shape)), run(tiny_model_dir(shape), tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=1e-4)


def test_dummy_weights_split_over_two_processes(tiny_model_dir, tmp_path):
    """Each rank draws the whole of every weight with the same seed and keeps its shard: TP=1's tokens."""
    from nanovllm.weights.synthetic import write_config

    config_only = str(write_config("tiny-llama", tmp_path, torch.float32)[0])
    one, two = run(tiny_model_dir("tiny-llama")), run(config_only, load_format="dummy", tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_four_cpu_processes_give_the_tokens_of_one(tmp_path):
    """TP=4 (a shape with 8 heads and 4 KV heads, so each rank holds one KV head): TP=1's tokens and logprobs."""
    from nanovllm.weights.synthetic import SHAPES, write_config

    shape = dict(SHAPES["tiny-llama"], num_attention_heads=8, num_key_value_heads=4)
    path = str(write_config(shape, tmp_path, torch.float32)[0])
    one, four = run(path, load_format="dummy"), run(path, load_format="dummy", tensor_parallel_size=4)
    for a, b in zip(one, four):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token in lp_a:
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=1e-4)


@pytest.mark.slow
@pytest.mark.slow  # the synthetic GGUF takes its vocabulary from the bundled model
def test_gguf_blocks_kept_quantized_split_over_two_processes(tmp_path):
    """Q8_0 blocks sharded as they are (rows of qkv / gate_up / the vocabulary, whole blocks of o / down's rows): the
    first token's logprobs of one process (kept quantized on CPU, each rank's partial sums round to bf16 where one
    process's whole sums do: near ties of random weights may then part, so later tokens are not compared)."""
    from nanovllm.weights.synthetic import SHAPES
    from nanovllm.weights.synthetic_gguf import write_gguf

    path = str(write_gguf(SHAPES["tiny-llama-128"], "Q8_0", str(tmp_path / "tiny-q8_0.gguf")))
    one, two = run(path, quantization="gguf"), run(path, quantization="gguf", tensor_parallel_size=2)
    for a, b in zip(one, two):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert first_a.keys() & first_b.keys()
        for token in first_a.keys() & first_b.keys():
            assert first_a[token].logprob == pytest.approx(first_b[token].logprob, abs=0.05)


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_weights_quantized_at_load_split_over_two_processes(tmp_path, name):
    """Each rank quantizes its shard: int4's groups of 128 along a row fall within a rank's columns, so the weights
    and tokens are TP=1's; int8's per-row scales of o / down cover a rank's columns only, a little off TP=1's, so
    the first tokens' logprobs agree to a few hundredths."""
    from nanovllm.weights.synthetic import SHAPES, write_model

    shape = dict(SHAPES["tiny-llama-128"], hidden_size=256, intermediate_size=512)  # 128 columns a rank at least
    path = str(write_model(shape, str(tmp_path), torch.float32, device="cpu"))
    one, two = run(path, quantization=name), run(path, quantization=name, tensor_parallel_size=2)
    for a, b in zip(one, two):
        if name == "int4":
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert first_a.keys() & first_b.keys()
        for token in first_a.keys() & first_b.keys():
            assert first_a[token].logprob == pytest.approx(first_b[token].logprob, abs=0.1)


def test_quantized_blocks_narrow_as_their_dequantized_weights():
    from nanovllm.quant.gguf_weight import GGUFWeight

    raw = torch.randint(0, 256, (6, 4 * 34), dtype=torch.uint8)  # Q8_0: 6 rows of 4 blocks of 32
    raw.view(6, 4, 34)[:, :, :2] = torch.tensor([0, 0x3c], dtype=torch.uint8)  # f16 scales of 1.0
    weight = GGUFWeight.from_blocks(raw, "Q8_0", (6, 128))
    torch.testing.assert_close(weight.narrow(0, 2, 3).dequantize(), weight.dequantize()[2:5])
    torch.testing.assert_close(weight.narrow(1, 64, 64).dequantize(), weight.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="whole blocks of 32"):
        weight.narrow(1, 16, 64)


@pytest.mark.parametrize("size,message", [
    (3, "does not divide the model's num_attention_heads"),
    (0, "tensor_parallel_size must be an integer >= 1"),
])
def test_a_size_that_cannot_split_the_model_is_refused_before_loading(tiny_model_dir, size, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir("tiny-llama"), device="cpu", tensor_parallel_size=size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_give_the_tokens_of_one(tiny_model_dir, dtype):
    """With CUDA graphs (their all-reduces, the logits' gather and the sampled tokens' broadcast captured), greedy and
    sampled. fp32: the same tokens; bf16: the all-reduce sums in another order, so near ties may break apart (the
    rate is printed)."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)  # the eager sampler
    outputs = []
    for size in (1, 2):
        llm = LLM(tiny_model_dir("tiny-llama-128"), device="cuda", dtype=dtype, max_model_len=128, max_num_seqs=16,
                  max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20, tensor_parallel_size=size)
        runner = llm.llm_engine.model_runner
        assert runner.graphs is not None
        outputs.append([o.outputs[0].token_ids for params in (GREEDY, sampled)
                        for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        assert runner.num_steady_steps > 0  # decode steps replayed with the inputs left on the devices
        if llm.llm_engine.workers is not None:
            started = time.monotonic()
            llm.llm_engine.workers.close()  # every rank frees its graphs, so NCCL's abort ends at once
            assert time.monotonic() - started < 5
        del llm
    pairs = [(a, b) for one, two in zip(*outputs) for a, b in zip(one, two)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"TP=2 vs TP=1 token agreement ({dtype}, greedy and sampled): {agreement:.1%}")
    if dtype == "float32":
        assert agreement == 1.0


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 1, reason="needs fewer than 2 GPUs")
def test_more_gpus_than_present_is_refused(tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError, match="GPU"):
        LLM(tiny_model_dir("tiny-llama"), device="cuda", tensor_parallel_size=2)


def test_a_dead_worker_fails_the_job_with_its_rank(tiny_model_dir):
    llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    workers = llm.llm_engine.workers
    workers.processes[0].kill()
    workers.processes[0].join()
    with pytest.raises(RuntimeError, match="nanovllm-tp1 exited"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    workers.close()


def test_dropping_the_engine_ends_its_workers(tiny_model_dir):
    llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    processes = list(llm.llm_engine.workers.processes)
    del llm
    gc.collect()  # the runner and its leader hold each other
    for process in processes:
        process.join(timeout=30)
        assert not process.is_alive()


def test_rank_0_failing_while_building_ends_the_workers_waiting_in_a_collective(tiny_model_dir, monkeypatch):
    """Rank 0 fails before the KV cache's block-count all-reduce, which the worker has entered: the error comes back
    at once (the worker is ended, not told to exit through a collective it cannot join)."""
    from nanovllm.kvcache import kv_cache

    def fail(*args):
        raise ValueError("rank 0 failed on purpose")

    monkeypatch.setattr(kv_cache, "num_device_blocks", fail)  # rank 0's module only: the worker is another process
    started = time.monotonic()
    with pytest.raises(ValueError, match="on purpose"):
        LLM(tiny_model_dir("tiny-llama"), device="cpu", dtype="float32", max_model_len=128,
            kv_cache_memory_bytes=16 << 20, tensor_parallel_size=2)
    assert time.monotonic() - started < 60


def test_closing_frees_the_graphs_before_the_communicator(monkeypatch):
    """NCCL's abort waits for every CUDA graph that captured its collectives (on two GPUs the engine's close hung in
    it): the shut-down frees rank 0's graphs first."""
    from nanovllm.distributed import workers

    order = []

    class Graph:
        def reset(self):
            order.append("graph")

    graphs = [{1: Graph()}, {(1, 128): Graph()}]
    monkeypatch.setattr(workers, "destroy_tensor_parallel", lambda: order.append("communicator"))
    workers._shut_down([], threading.Event(), graphs)
    assert order == ["graph", "graph", "communicator"] and graphs == [{}, {}]


def test_an_nccl_abort_that_never_ends_is_a_warning_not_a_hang(monkeypatch):
    from nanovllm.distributed import pynccl

    never, warnings = threading.Event(), []

    class Library:
        def ncclCommAbort(self, comm):
            never.wait()

    communicator = pynccl.NcclCommunicator.__new__(pynccl.NcclCommunicator)
    communicator.lib, communicator.comm = Library(), ctypes.c_void_p(1)
    monkeypatch.setattr(pynccl, "ABORT_WAIT_S", 0.2)
    monkeypatch.setattr(pynccl.logger, "warning", warnings.append)
    started = time.monotonic()
    communicator.destroy()
    assert time.monotonic() - started < 5 and not communicator.comm
    assert "did not end" in warnings[0]
    never.set()


@pytest.mark.slow
def test_smollm2_over_three_cpu_processes_gives_the_tokens_of_one(smollm2_path):
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks of 3 heads and 1 KV head each (2 cannot divide them)."""
    one, three = run(smollm2_path), run(smollm2_path, tensor_parallel_size=3)
    for a, b in zip(one, three):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("offload", [
    dict(kv_offloading_size=0.01, num_gpu_blocks_override=4, preemption_mode="swap"),  # offloaded steps, swaps
    dict(cpu_offload_gb=1e-6),  # the first decoder layer streamed from host memory on every rank
])
def test_offloading_splits_over_two_processes(tiny_model_dir, offload):
    """Each rank offloads its own heads' KV (rank 0's host pool copies run on every rank) or streams its own
    layers' shards: the tokens of one process."""
    model = tiny_model_dir("tiny-llama")
    kw = dict(offload, block_size=16)

    def offloaded(engine):
        if "kv_offloading_size" in kw:
            assert engine.scheduler.num_swaps + engine.block_manager.num_offloaded_blocks > 0
        else:
            assert engine.model_runner.streamer.streamed == [0]

    one, two = run(model, **kw), run(model, offloaded, tensor_parallel_size=2, **kw)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
