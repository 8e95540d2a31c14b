"""GPU checks (run on the device): HF fidelity on CUDA, in fp32 (identical tokens) and bf16 (agreement rate)."""
import pytest
import torch
from conftest import assert_no_leaks
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SMALL = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=4096, hidden_size=256,
             intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=2048, rope_theta=1000000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from nanovllm.weights.synthetic import write_model

    return str(write_model(SMALL, tmp_path_factory.mktemp("small-qwen3"), torch.float32))


def _prompts(n=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4096, (int(k),), generator=g).tolist() for k in torch.randint(5, 300, (n,), generator=g)]


def _agreement(small_model, dtype, new_tokens=32, max_num_seqs=256):
    """(free-running, teacher-forced) agreement of our greedy tokens with HF's on the same weights
    (max_num_seqs=1: one sequence at a time, the bs=1 decode kernels).
    Free-running: tokens before each prompt's first divergence (one bf16 near-tie ends a prompt's count).
    Teacher-forced: positions where our token is HF's argmax given the same preceding tokens (ours)."""
    hf = AutoModelForCausalLM.from_pretrained(small_model, dtype=dtype).cuda().eval()
    llm = LLM(small_model, device="cuda", dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.5,
              max_num_seqs=max_num_seqs)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens), use_tqdm=False)
    matched, forced, total = 0, 0, 0
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        ref = _hf_cuda_greedy(hf, prompt, new_tokens)
        same = 0
        for a, b in zip(ours, ref):
            if a != b:
                break
            same += 1
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours], device="cuda")).logits[0, len(prompt) - 1:-1]
        forced += (logits.argmax(-1).cpu() == torch.tensor(ours)).sum().item()
        matched, total = matched + same, total + new_tokens
    assert_no_leaks(llm)
    return matched / total, forced / total


def _hf_cuda_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_fp32_identical_to_hf_on_cuda(small_model):
    free, forced = _agreement(small_model, torch.float32)
    assert free == 1.0 and forced >= 0.99  # HF's own full-sequence and incremental logits differ at fp32 rounding


@pytest.mark.parametrize("max_num_seqs", [256, 1])
def test_bf16_agreement_with_hf_on_cuda(small_model, max_num_seqs):
    free, forced = _agreement(small_model, torch.bfloat16, max_num_seqs=max_num_seqs)
    print(f"\nbf16 greedy agreement with HF (max_num_seqs={max_num_seqs}): {free:.1%} of tokens before the first "
          f"divergence, {forced:.1%} of positions teacher-forced")
    # bf16 near-ties flip single positions; a real error (wrong attention, rope, weights) picks tokens that are
    # far from HF's argmax at most positions
    assert forced >= 0.8


def test_dummy_weights_drawn_on_the_gpu_are_the_written_ones(small_model, tmp_path):
    """load_format="dummy" draws on the GPU the values write_model drew there (same seed): the same tokens."""
    from nanovllm.weights.synthetic import write_config

    config_only = str(write_config(SMALL, tmp_path, torch.float32)[0])
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(device="cuda", dtype=torch.float32, max_model_len=1024, gpu_memory_utilization=0.3)
    written = LLM(small_model, **kw).generate(prompts, params, use_tqdm=False)
    drawn = LLM(config_only, load_format="dummy", **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in written] == [o.outputs[0].token_ids for o in drawn]


def test_weights_larger_than_the_gpu_are_a_clear_error_and_leave_it_free(tmp_path):
    """Twice a 70B-class model's layers, drawn at load: the build runs out of memory, the error says what makes room,
    and the memory the half-built model took is given back."""
    from nanovllm.weights.synthetic import SHAPES, write_config

    path = str(write_config(dict(SHAPES["llama3-70b"], num_hidden_layers=160), tmp_path, torch.bfloat16)[0])
    free_before = torch.cuda.mem_get_info()[0]
    with pytest.raises(torch.OutOfMemoryError, match="do not fit on cuda.*cpu_offload_gb"):
        LLM(path, load_format="dummy", device="cuda", max_model_len=256)
    assert torch.cuda.mem_get_info()[0] > free_before - (1 << 30)


def test_gpu_kv_cache_sized_from_free_memory(small_model):
    llm = LLM(small_model, device="cuda", gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    kv_bytes = llm.llm_engine.model_runner.kv_cache.numel() * llm.llm_engine.model_runner.kv_cache.element_size()
    assert 0.1 * total < kv_bytes < 0.3 * total
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(small_model, device="cuda", gpu_memory_utilization=0.0001)


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
@pytest.mark.parametrize("max_num_seqs", [256, 1])  # 1: every decode step runs the bs=1 kernels
def test_cuda_graphs_match_eager(small_model, max_num_seqs, backend):
    """Graph replays give the eager tokens, greedy, seeded and top-p; steps with prefills replay graphs too where the
    backend allows it (flash_attn's varlen call takes host integers: those steps stay eager)."""
    from nanovllm.attention.flash_attn_backend import flash_attn_available

    if backend == "flash_attn" and not flash_attn_available():
        pytest.skip("flash_attn is not importable")
    prompts = [{"prompt_token_ids": p} for p in _prompts(12)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(small_model, device="cuda", dtype=torch.bfloat16, max_model_len=1024, gpu_memory_utilization=0.3,
                  enforce_eager=eager, max_num_seqs=max_num_seqs, attention_backend=backend)
        runner = llm.llm_engine.model_runner
        prefill_graphs = not eager and runner.backend.supports_prefill_graphs
        assert (runner.graphs is None) == eager and (runner.prefill_graphs is not None) == prefill_graphs
        replays = []
        if prefill_graphs:  # the prompts (5-300 tokens) must go through the prefill graphs, not around them
            run = runner.prefill_graphs.run
            runner.prefill_graphs.run = lambda *a: replays.append(1) or run(*a)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert replays or not prefill_graphs
        if prefill_graphs:
            del runner.prefill_graphs.run, run  # both hold the model, and through it the KV cache
        # seeded draws, sequences ending at different steps (the batch shrinks mid-decode), then top-p (sampled
        # outside the graphs)
        seeded = [SamplingParams(temperature=1.0, seed=3, max_tokens=20 + 3 * i, ignore_eos=True)
                  for i in range(len(prompts))]
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)])
        steady_before_top_p = runner.num_steady_steps
        top_p = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, top_p, use_tqdm=False)])
        # decode steps of an unchanged batch replayed with their inputs left on the device (most of them), top-p
        # ones too (sampled outside the graphs)
        assert (steady_before_top_p > 60) != eager, steady_before_top_p
        assert (runner.num_steady_steps - steady_before_top_p > 15) != eager, runner.num_steady_steps
        del runner
        assert_no_leaks(llm)
        del llm
        torch.cuda.empty_cache()
    assert outs[:3] == outs[3:]


def test_decode_plan_follows_the_context_not_max_model_len(small_model, tmp_path):
    """bs=1 decode with the model's own max_model_len (40,960) replays the decode graphs of the context bounds that
    hold each step, not one planned for 40,960 tokens: the tokens and logprobs are those of an engine whose
    max_model_len is 1,024, bit for bit (the same kernels, planned alike)."""
    from nanovllm.weights.synthetic import write_model

    long_model = str(write_model(dict(SMALL, max_position_embeddings=40960), tmp_path, torch.float32))
    prompts = [{"prompt_token_ids": p} for p in _prompts(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    results, bounds = [], []
    for path, max_model_len in ((long_model, None), (small_model, 1024)):
        llm = LLM(path, device="cuda", dtype=torch.bfloat16, max_model_len=max_model_len, max_num_seqs=1,
                  num_gpu_blocks_override=2600)  # 41,600 tokens: room for one sequence of 40,960
        graphs = llm.llm_engine.model_runner.graphs
        key = graphs._key
        graphs._key = lambda n, longest: bounds.append(key(n, longest)[1]) or key(n, longest)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs])
        del graphs._key
        graphs = key = llm = None  # the first engine goes before the second comes
        torch.cuda.empty_cache()
    assert results[0] == results[1]
    assert bounds and max(bounds) <= 512, sorted(set(bounds))  # prompts of 5-300 tokens, 40 new


def test_triton_backend_matches_torch_backend_on_cuda(small_model):
    prompts = [{"prompt_token_ids": p} for p in _prompts(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(small_model, device="cuda", dtype=torch.float32, max_model_len=1024, gpu_memory_utilization=0.3,
                  attention_backend=backend, max_num_batched_tokens=256)  # chunked prefill over cached prefixes
        results[backend] = llm.generate(prompts, params, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
    for a, b in zip(results["torch"], results["triton"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-3 for t in ea)
