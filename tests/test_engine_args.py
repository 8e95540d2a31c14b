"""vLLM's engine arguments as the scripts written for vLLM pass them: lm-evaluation-harness's vLLM backend, and
vLLM's offline examples, which pass every EngineArgs field at its default (LLM(**vars(args)))."""
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine_args import FEATURES, NO_EFFECT

# lm-evaluation-harness's VLLM.__init__ model_args, with its defaults (max_batch_size=None gives max_num_seqs=None)
LM_EVAL_ARGS = dict(gpu_memory_utilization=0.9, revision=None, dtype="auto", tokenizer=None, tokenizer_mode="auto",
                    tokenizer_revision=None, trust_remote_code=False, tensor_parallel_size=1, max_model_len=None,
                    max_num_seqs=None, swap_space=4, quantization=None, seed=1234, enable_lora=False,
                    max_lora_rank=16)

# vLLM's EngineArgs fields at their defaults, as its examples/offline_inference/basic/generate.py passes them
ENGINE_ARGS_DEFAULTS = dict(
    served_model_name=None, tokenizer=None, hf_config_path=None, runner="auto", convert="auto", task=None,
    skip_tokenizer_init=False, enable_prompt_embeds=False, tokenizer_mode="auto", trust_remote_code=False,
    allowed_local_media_path="", allowed_media_domains=None, download_dir=None, safetensors_load_strategy="lazy",
    load_format="auto", config_format="auto", dtype="auto", kv_cache_dtype="auto", seed=0, max_model_len=None,
    cuda_graph_sizes=None, cudagraph_capture_sizes=None, max_cudagraph_capture_size=None,
    distributed_executor_backend=None, pipeline_parallel_size=1, tensor_parallel_size=1,
    decode_context_parallel_size=1, data_parallel_size=1, data_parallel_rank=None, data_parallel_start_rank=None,
    data_parallel_size_local=None, data_parallel_address=None, data_parallel_rpc_port=None,
    data_parallel_hybrid_lb=False, data_parallel_backend="mp", enable_expert_parallel=False, all2all_backend=None,
    enable_dbo=False, dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512,
    disable_nccl_for_dp_synchronization=False, eplb_config={}, enable_eplb=False, expert_placement_strategy="linear",
    _api_process_count=1, _api_process_rank=0, num_redundant_experts=0, eplb_window_size=1000,
    eplb_step_interval=3000, eplb_log_balancedness=False, max_parallel_loading_workers=None, block_size=None,
    enable_prefix_caching=None, prefix_caching_hash_algo="sha256", disable_sliding_window=False,
    disable_cascade_attn=False, swap_space=4, cpu_offload_gb=0, gpu_memory_utilization=0.9,
    kv_cache_memory_bytes=None, max_num_batched_tokens=None, max_num_partial_prefills=1, max_long_partial_prefills=1,
    long_prefill_token_threshold=0, max_num_seqs=None, max_logprobs=20, logprobs_mode="raw_logprobs",
    disable_log_stats=False, aggregate_engine_logging=False, revision=None, code_revision=None, rope_scaling={},
    rope_theta=None, hf_token=None, hf_overrides={}, tokenizer_revision=None, quantization=None, enforce_eager=False,
    disable_custom_all_reduce=False, limit_mm_per_prompt={}, enable_mm_embeds=False, interleave_mm_strings=False,
    media_io_kwargs={}, mm_processor_kwargs=None, disable_mm_preprocessor_cache=False, mm_processor_cache_gb=4,
    mm_processor_cache_type="lru", mm_shm_cache_max_object_size_mb=128, mm_encoder_tp_mode="weights",
    mm_encoder_attn_backend=None, io_processor_plugin=None, skip_mm_profiling=False, video_pruning_rate=0.0,
    enable_lora=False, max_loras=1, max_lora_rank=16, default_mm_loras=None, fully_sharded_loras=False,
    max_cpu_loras=None, lora_dtype="auto", lora_extra_vocab_size=256, ray_workers_use_nsight=False,
    num_gpu_blocks_override=None, num_lookahead_slots=0, model_loader_extra_config={}, ignore_patterns=None,
    enable_chunked_prefill=None, disable_chunked_mm_input=False, disable_hybrid_kv_cache_manager=False,
    structured_outputs_config={}, reasoning_parser="", guided_decoding_backend=None,
    guided_decoding_disable_fallback=None, guided_decoding_disable_any_whitespace=None,
    guided_decoding_disable_additional_properties=None, logits_processor_pattern=None, speculative_config=None,
    show_hidden_metrics_for_version=None, otlp_traces_endpoint=None, collect_detailed_traces=None,
    scheduling_policy="fcfs", scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler", external_parameters=None,
    pooler_config=None, override_pooler_config=None, compilation_config={"level": 0}, worker_cls="auto",
    worker_extension_cls="", kv_transfer_config=None, kv_events_config=None, generation_config="auto",
    enable_sleep_mode=False, override_generation_config={}, model_impl="auto", override_attention_dtype=None,
    calculate_kv_scales=False, mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", mamba_block_size=None,
    additional_config={}, use_tqdm_on_load=True, pt_load_map_location="cpu",
    enable_multimodal_encoder_data_parallel=False, logits_processors=None, async_scheduling=False,
    kv_sharing_fast_prefill=False)


def test_lm_eval_harness_arguments_construct_and_score(tiny_model_dir):
    """lm-eval's model_args, then its loglikelihood call: generate(prompt_token_ids=..., lora_request=None)."""
    llm = LLM(model=tiny_model_dir("tiny-llama"), device="cpu", **LM_EVAL_ARGS)
    assert llm.llm_engine.config.max_num_seqs == 256 and llm.llm_engine.model_config.max_model_len == 1024
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    outs = llm.generate(prompt_token_ids=[[5, 6, 7, 8], [9, 10]], sampling_params=params, use_tqdm=False,
                        lora_request=None)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7, 8], [9, 10]]
    assert outs[0].prompt_logprobs[0] is None and 6 in outs[0].prompt_logprobs[1]


def test_vllm_example_passes_every_engine_arg_at_its_default(tiny_model_dir):
    llm = LLM(model=tiny_model_dir("tiny-llama"), device="cpu", **ENGINE_ARGS_DEFAULTS)
    config = llm.llm_engine.config
    assert config.enable_prefix_caching and not config.async_scheduling  # None: the default; False: honoured
    out = llm.generate(["a b c"], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_every_default_above_names_a_known_argument():
    """The names these tests pass are the ones engine_args lists (none is taken by a typo's luck)."""
    own = {"tokenizer", "dtype", "seed", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
           "gpu_memory_utilization", "enable_prefix_caching", "enforce_eager", "num_gpu_blocks_override",
           "kv_cache_memory_bytes", "async_scheduling", "quantization", "cpu_offload_gb", "tensor_parallel_size",
           "data_parallel_size", "disable_custom_all_reduce", "load_format"}
    assert set(ENGINE_ARGS_DEFAULTS) | set(LM_EVAL_ARGS) <= own | NO_EFFECT | FEATURES


@pytest.mark.parametrize("kwargs", [
    dict(enable_lora=True), dict(kv_cache_dtype="fp8"),
    dict(speculative_config={"method": "ngram"}), dict(pipeline_parallel_size=2),
    dict(skip_tokenizer_init=True), dict(tokenizer_mode="mistral"), dict(scheduling_policy="priority"),
])
def test_a_feature_nanovllm_lacks_is_refused_by_name(tiny_model_dir, kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(NotImplementedError, match=rf"{name}={value!r}".replace("[", r"\[").replace("{", r"\{")):
        LLM(tiny_model_dir("tiny-llama"), **kwargs)


def test_a_name_vllm_does_not_have_is_a_type_error(tiny_model_dir):
    with pytest.raises(TypeError, match="no_such_arg"):
        LLM(tiny_model_dir("tiny-llama"), no_such_arg=1)


def test_generate_refuses_what_it_cannot_serve(tiny_llm):
    with pytest.raises(NotImplementedError, match="lora_request"):
        tiny_llm.generate(["a"], lora_request=object())
    with pytest.raises(TypeError, match="prompts or prompt_token_ids"):
        tiny_llm.generate(["a"], prompt_token_ids=[[1, 2]])
    assert len(tiny_llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])) == 1


def test_the_kv_cache_log_gives_its_concurrency_for_max_model_len(tiny_model_dir, caplog):
    """vLLM's "maximum concurrency" figure: how many sequences of max_model_len the KV cache holds at once, in the
    execution plan's KV cache row."""
    with caplog.at_level("INFO", logger="nanovllm"):
        LLM(tiny_model_dir("tiny-llama"), device="cpu", max_model_len=128, num_gpu_blocks_override=24, block_size=16)
    assert "execution plan:" in caplog.text and "KV cache     24 blocks of 16 tokens" in caplog.text
    assert "maximum concurrency for 128 tokens a sequence: 3.00x" in caplog.text


def test_one_list_of_engine_arguments():
    """Config's fields are the engine arguments: the README's LLM() line names each with its default, in order;
    run-batch has a flag for each; none is also sorted among vLLM's arguments that nanovllm ignores or lacks."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from nanovllm.config import Config, engine_arg_names
    from nanovllm.entrypoints import run_batch

    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    signature = re.search(r"`LLM\(model, (.*?), \*\*vllm_engine_args\)`", readme, re.S).group(1)
    defaults = {f.name: f.default for f in fields(Config)}
    listed = [part.split("=") for part in re.split(r",\s+", signature)]
    assert [name for name, _ in listed] == engine_arg_names()
    assert all(eval(value) == defaults[name] for name, value in listed)
    parser = run_batch.argparse.ArgumentParser()
    run_batch.add_arguments(parser)
    flags = {a.dest for a in parser._actions}
    assert set(engine_arg_names()) <= flags
    assert not set(engine_arg_names()) & (NO_EFFECT | FEATURES)


def test_swap_space_constructs_an_engine(tiny_model_dir):
    """vLLM scripts pass swap_space (its CPU swap GiB); nanovllm's is kv_offloading_size, so it has no effect."""
    llm = LLM(tiny_model_dir("tiny-llama"), device="cpu", max_model_len=128, swap_space=4)
    assert llm.llm_engine.scheduler.host_pool is None
