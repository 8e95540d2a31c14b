import time
from collections.abc import Sequence as Seq
from itertools import count

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.inputs import PromptType
from nanovllm.logger import log_once
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

# vLLM arguments that change nothing here; accepted so that vLLM scripts run unchanged.
_IGNORED_ARGS = {"trust_remote_code", "disable_log_stats", "swap_space", "revision", "tokenizer_revision",
                 "tokenizer_mode", "enable_chunked_prefill", "disable_custom_all_reduce", "max_logprobs",
                 "compilation_config", "cpu_offload_gb", "download_dir", "load_format"}


class LLM:
    """vLLM's offline entry point: LLM(model).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str, tokenizer: str | None = None, dtype="auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.9, block_size: int | None = None, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False, async_scheduling: bool = True, seed: int = 0,
                 num_gpu_blocks_override: int | None = None,
                 kv_cache_memory_bytes: int | None = None, attention_backend: str | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None, **kwargs):
        unknown = set(kwargs) - _IGNORED_ARGS
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {sorted(unknown)}")
        for name in sorted(kwargs):
            log_once(f"LLM(): argument {name!r} has no effect in nanovllm and is ignored")
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: nanovllm runs on one device for now")
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} is not supported yet (GGUF files load dequantized)")
        config = Config(model=model, tokenizer=tokenizer, dtype=dtype, device=device, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
                        enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                        async_scheduling=async_scheduling, seed=seed,
                        num_gpu_blocks_override=num_gpu_blocks_override,
                        kv_cache_memory_bytes=kv_cache_memory_bytes, attention_backend=attention_backend)
        self.llm_engine = LLMEngine(config)
        self._request_counter = count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so that the next prompts compute every token (repeated benchmark runs);
        False while requests still hold KV blocks."""
        return self.llm_engine.block_manager.reset_prefix_cache()

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer()(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.get_tokenizer()(prompt["prompt"]).input_ids
        raise TypeError(f"a prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                        f"got {type(prompt).__name__}")

    def generate(self, prompts: PromptType | Seq[PromptType], sampling_params=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        requests = [(*self._tokenize(prompt), params) for prompt, params in zip(prompts, sampling_params)]
        return self._run(requests, use_tqdm)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (text, prompt_ids, params) in enumerate(requests):
                ids.append(str(next(self._request_counter)))
                try:  # add_request validates; a bad prompt stops the call before any step runs
                    engine.add_request(ids[-1], prompt_ids, params, prompt=text)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            outputs = self._drain(ids, sum(p.n for _, _, p in requests), use_tqdm)
        except BaseException:
            engine.abort_request(ids)  # free every block this call took; the engine stays usable
            raise
        return [outputs[i] for i in ids]

    def _drain(self, ids: list[str], total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        outputs: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        with tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    outputs[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_tokens / elapsed:.0f} tok/s, output: {out_tokens / elapsed:.0f} tok/s")
                    bar.update(len(out.outputs))
        return outputs

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
