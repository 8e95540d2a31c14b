"""`nanovllm generate MODEL "prompt"` (one completion, printed as it is sampled) and `nanovllm chat MODEL` (a
conversation through the model's chat template, each answer streamed; an empty line or end of input ends it), with
the sampling flags below and every engine argument as a flag (--seed: the engine's)."""
import argparse
import sys

from nanovllm.entrypoints.engine_flags import add_engine_arguments, engine_kwargs
from nanovllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser, with_prompt: bool):
    parser.add_argument("model", help="an HF model directory or a GGUF file")
    if with_prompt:
        parser.add_argument("prompt", help="the text to complete")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    add_engine_arguments(parser)


def sampling_params(args) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


def stream(llm, prompt_ids: list[int], params: SamplingParams, out=None) -> str:
    """Run one request, writing its text to out (stdout) as the steps produce it; its whole text."""
    engine, request_id, written, out = llm.llm_engine, "cli", 0, out or sys.stdout
    engine.add_request(request_id, prompt_ids, params)
    try:
        while engine.has_unfinished_requests():
            finished = engine.step()
            seq = finished[0].outputs[0] if finished else engine.requests[request_id].seqs[0]
            text = seq.text
            out.write(text[written:])
            out.flush()
            written = len(text)
    except BaseException:
        engine.abort_request(request_id)
        raise
    return text


def generate(args) -> int:
    from nanovllm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    stream(llm, llm.get_tokenizer()(args.prompt).input_ids, sampling_params(args))
    print()
    return 0


def chat(args, lines=None) -> int:
    from nanovllm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params, conversation = sampling_params(args), []
    for line in lines or sys.stdin:
        if not line.strip():
            break
        conversation.append({"role": "user", "content": line.strip()})
        answer = stream(llm, llm.chat_prompt(conversation)["prompt_token_ids"], params)
        print()
        conversation.append({"role": "assistant", "content": answer})
    return 0
