"""vLLM's engine arguments beyond the ones LLM() names itself, so that scripts and harnesses written for vLLM
(lm-evaluation-harness, vLLM's own examples, which pass every EngineArgs field at its default) run unchanged.

Each name is either without effect here at any value (NO_EFFECT), or asks for a feature that nanovllm does not
have unless its value is that feature's off value (the neutral values, or NEUTRAL for names whose off value is
another): such a value is accepted, any other raises NotImplementedError naming the argument. A name vLLM does not
have raises TypeError, as vLLM does."""
from nanovllm.logger import log_once

# Any value changes nothing here: hub and download settings (models are local paths), logging, CPU swap for
# preemption (nanovllm's is kv_offloading_size), torch.compile and CUDA graph sizes (nanovllm captures its own buckets), and the
# tuning knobs of features that are off (LoRA, multimodal, expert parallel) or absent from the models nanovllm runs.
NO_EFFECT = frozenset({
    "trust_remote_code", "revision", "tokenizer_revision", "code_revision", "download_dir", "hf_token",
    "served_model_name", "disable_log_stats", "aggregate_engine_logging", "swap_space", "max_logprobs",
    "compilation_config", "cuda_graph_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "max_seq_len_to_capture", "max_context_len_to_capture",
    "max_parallel_loading_workers", "ray_workers_use_nsight", "use_tqdm_on_load", "pt_load_map_location",
    "safetensors_load_strategy", "prefix_caching_hash_algo", "disable_cascade_attn", "disable_sliding_window",
    "use_v2_block_manager", "disable_async_output_proc", "enable_chunked_prefill", "tokenizer_pool_size",
    "tokenizer_pool_type", "tokenizer_pool_extra_config", "max_loras", "max_lora_rank", "max_cpu_loras",
    "lora_dtype", "lora_extra_vocab_size", "fully_sharded_loras", "long_lora_scaling_factors",
    "allowed_local_media_path", "allowed_media_domains", "limit_mm_per_prompt", "media_io_kwargs",
    "disable_mm_preprocessor_cache", "mm_processor_cache_gb", "mm_processor_cache_type",
    "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode", "mm_encoder_attn_backend", "skip_mm_profiling",
    "video_pruning_rate", "interleave_mm_strings", "disable_chunked_mm_input", "eplb_config",
    "num_redundant_experts", "eplb_window_size", "eplb_step_interval", "eplb_log_balancedness",
    "expert_placement_strategy", "all2all_backend", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
    "disable_nccl_for_dp_synchronization", "data_parallel_backend", "data_parallel_rank",
    "data_parallel_start_rank", "data_parallel_size_local", "data_parallel_address", "data_parallel_rpc_port",
    "_api_process_count", "_api_process_rank", "max_num_partial_prefills", "max_long_partial_prefills",
    "long_prefill_token_threshold", "num_lookahead_slots", "disable_hybrid_kv_cache_manager",
    "guided_decoding_backend", "guided_decoding_disable_fallback", "guided_decoding_disable_any_whitespace",
    "guided_decoding_disable_additional_properties", "structured_outputs_config", "reasoning_parser",
    "logits_processor_pattern", "show_hidden_metrics_for_version", "otlp_traces_endpoint",
    "collect_detailed_traces", "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size",
    "kv_sharing_fast_prefill", "ignore_patterns", "model_loader_extra_config", "multi_step_stream_outputs",
    "generation_config", "override_generation_config", "io_processor_plugin", "default_mm_loras",
    "override_attention_dtype", "enable_multimodal_encoder_data_parallel",
})

# The values of other names that ask for nothing nanovllm lacks, beside the neutral None / False / 0 / "" / "auto"
# / empty containers: for instance pipeline_parallel_size=1, config_format="hf".
NEUTRAL = {
    "pipeline_parallel_size": (1,),
    "decode_context_parallel_size": (1,), "config_format": ("hf",),
    "tokenizer_mode": ("hf",), "runner": ("generate",), "convert": ("none",), "task": ("generate",),
    "model_impl": ("vllm",), "logprobs_mode": ("raw_logprobs",), "scheduling_policy": ("fcfs",),
    "scheduler_cls": ("vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler"),
    "worker_cls": (), "worker_extension_cls": (), "distributed_executor_backend": ("uni", "mp"),
"num_scheduler_steps": (1,), "additional_config": (),
}

# vLLM's names whose non-neutral values ask for features nanovllm does not have yet
FEATURES = frozenset(NEUTRAL) | {
    "kv_cache_dtype", "calculate_kv_scales", "enable_lora", "enable_prompt_embeds",
    "skip_tokenizer_init", "enable_expert_parallel", "enable_eplb", "enable_dbo", "data_parallel_hybrid_lb",
    "speculative_config", "speculative_model", "num_speculative_tokens", "ngram_prompt_lookup_max",
    "kv_transfer_config", "kv_events_config", "enable_sleep_mode", "hf_overrides", "hf_config_path", "rope_scaling",
    "rope_theta", "pooler_config", "override_pooler_config", "logits_processors", "mm_processor_kwargs",
    "enable_mm_embeds", "external_parameters", "enable_prompt_adapter", "max_prompt_adapters",
    "qlora_adapter_name_or_path",
}


def _is_off(name: str, value) -> bool:
    if value is None or value is False or value == 0 or value == "" or value == "auto":
        return True
    if isinstance(value, (dict, list, tuple, set)) and not value:
        return True
    return value in NEUTRAL.get(name, ())


def check_vllm_args(kwargs: dict):
    """Accept vLLM's engine arguments that ask for nothing nanovllm lacks, before any work starts: a name vLLM
    does not have raises TypeError, a value that asks for a missing feature NotImplementedError."""
    unknown = sorted(set(kwargs) - NO_EFFECT - FEATURES)
    if unknown:
        raise TypeError(f"LLM() got unknown arguments {unknown} (neither nanovllm's nor vLLM's engine arguments)")
    for name in sorted(FEATURES.intersection(kwargs)):
        if not _is_off(name, kwargs[name]):
            raise NotImplementedError(f"LLM({name}={kwargs[name]!r}): nanovllm does not support this yet; leave "
                                      f"{name} at its default")
    ignored = [f"{name}={kwargs[name]!r}" for name in sorted(NO_EFFECT.intersection(kwargs))
               if not _is_off(name, kwargs[name])]
    if ignored:
        log_once(f"LLM(): no effect in nanovllm, ignored: {', '.join(ignored)}")
