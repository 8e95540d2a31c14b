"""nanovllm as an lm-evaluation-harness model ("nanovllm"): `nanovllm lm-eval --model nanovllm --model_args
pretrained=PATH,max_model_len=4096 --tasks ...` runs lm_eval's command line with it registered (lm_eval finds
models only among those imported), and `import nanovllm.entrypoints.lm_eval` registers it for
lm_eval.simple_evaluate. model_args other than pretrained are engine arguments.

loglikelihood and loglikelihood_rolling score each request's continuation from the prompt logprobs of one engine
pass over context + continuation (every request of a call in one batched generate); generate_until samples with
the request's until strings as stop strings. Tokenization follows lm-eval's HF model: the context's trailing spaces
move to the continuation, the continuation's tokens are those the whole text adds to the context's."""
import sys

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nanovllm import LLM, SamplingParams


@register_model("nanovllm")
class NanoVLLM(LM):
    def __init__(self, pretrained: str, max_length: int | None = None, **engine_args):
        super().__init__()
        if max_length is not None:
            engine_args.setdefault("max_model_len", int(max_length))
        self.llm = LLM(pretrained, **engine_args)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_length = self.llm.llm_engine.model_config.max_model_len
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        self.prefix_token_id = bos if bos is not None else eos

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "NanoVLLM":
        """The engine's arguments come from --model_args alone: lm_eval's own --device and --batch_size are not
        passed on (the engine picks its device, "auto", and batches every request of a call)."""
        return cls(**arg_dict)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "NanoVLLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix_token_id], self._encode(continuation)
        whole, context_ids = self._encode(context + continuation), self._encode(context)
        return context_ids, whole[len(context_ids):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._score([self._pair(*request.args) for request in requests])

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether each of its tokens is the greedy one) of each pair, the
        context cut from the left where the pair is longer than the model's context."""
        prompts, spans = [], []
        for context, continuation in pairs:
            ids = (context + continuation)[-self.max_length:]
            prompts.append({"prompt_token_ids": ids})
            spans.append(min(len(continuation), len(ids) - 1))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for prompt, span, out in zip(prompts, spans, outputs):
            ids, entries = prompt["prompt_token_ids"], out.prompt_logprobs
            scored = [entries[i][ids[i]] for i in range(len(ids) - span, len(ids))]
            results.append((sum(e.logprob for e in scored), all(e.rank == 1 for e in scored)))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood in windows of the model's context (lm-eval's rolling windows, a token short of
        it: a window's tokens, its first context token included, are one prompt)."""
        pairs, owners = [], []
        for i, request in enumerate(requests):
            windows = get_rolling_token_windows(self._encode(request.args[0]), self.prefix_token_id,
                                                self.max_length - 1, context_len=1)
            for window in map(make_disjoint_window, windows):
                pairs.append(window)
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(pairs)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            max_tokens = kwargs.pop("max_gen_toks", 256)
            greedy = not kwargs.pop("do_sample", False) or kwargs.get("temperature", 0) == 0
            ids = self._encode(context)[-(self.max_length - max_tokens):]
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(max_tokens=max_tokens, stop=[until] if isinstance(until, str) else until,
                                         temperature=0 if greedy else kwargs.get("temperature", 1.0),
                                         top_p=kwargs.get("top_p", 1.0)))
        return [out.outputs[0].text for out in self.llm.generate(prompts, params, use_tqdm=False)]


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line, with the nanovllm model registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(argv if argv is not None else sys.argv[1:])]
    cli_evaluate()
    return 0
