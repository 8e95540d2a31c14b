import contextlib
import time
from collections.abc import Sequence as Seq
from itertools import count

import torch
from tqdm.auto import tqdm

from nanovllm.config import Config, engine_arg_names
from nanovllm.distributed.main_guard import require_main_guard
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.scheduler import NoProgressError
from nanovllm.engine_args import check_vllm_args
from nanovllm.inputs import PromptType
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

PROMPT_TYPES = "a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


def _prompt_list(prompts, prompt_token_ids) -> list:
    """generate()'s prompts as a list, checked for type before any work."""
    if prompt_token_ids is not None:
        if prompts is not None:
            raise TypeError("generate() takes prompts or prompt_token_ids, not both")
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompt_token_ids):
            raise TypeError("prompt_token_ids must be a list of lists of token ids")
        return [{"prompt_token_ids": p} for p in prompt_token_ids]
    if prompts is None:
        raise TypeError(f"generate() needs prompts: {PROMPT_TYPES}, or a list of them")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Seq):
        raise TypeError(f"prompts must be a prompt or a list of them ({PROMPT_TYPES}), got {type(prompts).__name__}")
    return list(prompts)


class LLM:
    """vLLM's offline entry point: LLM(model).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str, **kwargs):
        """kwargs: the engine arguments (Config's fields, nanovllm.config.engine_arg_names(); the README lists them),
        and vLLM's other engine arguments (nanovllm.engine_args: accepted where they ask for nothing nanovllm
        lacks)."""
        names = set(engine_arg_names())
        check_vllm_args({name: value for name, value in kwargs.items() if name not in names})
        for setting in ("tensor_parallel_size", "data_parallel_size"):
            if isinstance(kwargs.get(setting), int) and kwargs[setting] > 1:
                require_main_guard(f"{setting}={kwargs[setting]}")
        config = Config(model=model, **{name: value for name, value in kwargs.items() if name in names})
        self.llm_engine = LLMEngine(config)
        self._request_counter = count()
        self.replicas = None
        if config.data_parallel_size > 1:  # the same engine N-1 more times, in processes of their own
            from nanovllm.distributed.data_parallel import DataParallelReplicas

            self.replicas = DataParallelReplicas(config.data_parallel_size, model, {**kwargs, "data_parallel_size": 1})

    def shutdown(self):
        """Give up the engine: its worker processes and replicas end, and its GPU memory (returned to the device),
        pinned host memory and offload files are freed once nothing else refers to them. `del llm` and the end of
        `with LLM(...) as llm:` do the same."""
        engine, replicas = self.__dict__.pop("llm_engine", None), self.__dict__.pop("replicas", None)
        if replicas is not None:
            replicas.close()
        if engine is not None:
            engine.shutdown()
            del engine
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info):
        self.shutdown()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the modules it needs may be gone already
            self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, so that the next prompts compute every token (repeated benchmark runs);
        False while requests still hold KV blocks."""
        return self.llm_engine.block_manager.reset_prefix_cache()

    def _tokenize(self, i: int, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer()(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.get_tokenizer()(prompt["prompt"]).input_ids
        raise TypeError(f"prompt {i}: {PROMPT_TYPES}, got {type(prompt).__name__}")

    def generate(self, prompts: PromptType | Seq[PromptType] | None = None, sampling_params=None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None, *,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """vLLM's generate: outputs in input order. prompt_token_ids: the older vLLM keyword (lm-evaluation-harness
        passes it), lists of token ids instead of prompts."""
        prompts = _prompt_list(prompts, prompt_token_ids)
        if lora_request is not None:
            raise NotImplementedError("generate(lora_request=...): nanovllm does not support LoRA adapters yet")
        if priority is not None and any(priority):
            raise NotImplementedError("generate(priority=...): nanovllm schedules first come, first served")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        requests = [(*self._tokenize(i, prompt), params) for i, (prompt, params) in enumerate(zip(prompts, sampling_params))]
        return self._run(requests, use_tqdm)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        if self.replicas is not None:
            for i, (_, prompt_ids, params) in enumerate(requests):  # every prompt checked before any replica starts
                try:
                    self.llm_engine.validate_prompt(prompt_ids, params)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
            return self.replicas.run(requests, lambda share: self._run_here(share, use_tqdm))
        return self._run_here(requests, use_tqdm)

    def _run_here(self, requests, use_tqdm: bool) -> list[RequestOutput]:
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
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        outputs[out.request_id] = out
                        in_tokens += len(out.prompt_token_ids)
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"input: {in_tokens / elapsed:.0f} tok/s, output: {out_tokens / elapsed:.0f} tok/s")
                        bar.update(len(out.outputs))
            except NoProgressError as e:
                e.finished = [outputs[i] for i in ids if i in outputs]  # what finished before, in input order
                raise
        return outputs

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(conversation, chat_template, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, conversation: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> dict:
        """One conversation through the model's chat template: {"prompt": text, "prompt_token_ids": ids}."""
        for i, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                raise ValueError(f"chat message {i} must be a dict with a 'role' string and 'content': got {message!r}")
        tokenizer = self.get_tokenizer()
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}
