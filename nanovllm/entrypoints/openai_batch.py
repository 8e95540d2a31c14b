"""The OpenAI batch file format (vLLM's `run-batch`): a request line is {"custom_id", "method": "POST", "url":
"/v1/chat/completions" or "/v1/completions", "body": {...}}; an output line is {"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}. Parsing a line checks what nanovllm can serve and names what it
cannot, so that a bad line becomes an error entry instead of stopping the job."""
import json
import time
from dataclasses import dataclass

from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# body fields -> SamplingParams fields; the others a body may hold without changing the result
SAMPLING_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "n": "n", "stop": "stop", "seed": "seed",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
NEUTRAL_FIELDS = {"model", "messages", "prompt", "user", "stream"}


@dataclass
class BatchRequest:
    line: int  # 1-based line of the input file
    custom_id: str
    url: str
    body: dict
    params: SamplingParams


class BadRequest(ValueError):
    pass


def parse_request(line_number: int, text: str) -> BatchRequest:
    """One input line, or BadRequest naming what is wrong with it."""
    try:
        request = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"not JSON: {e}") from None
    if not isinstance(request, dict) or not isinstance(request.get("custom_id"), str):
        raise BadRequest("a request needs a string custom_id")
    url, body = request.get("url"), request.get("body")
    if url not in (CHAT, COMPLETIONS):
        raise BadRequest(f"url {url!r} is not served: {CHAT} or {COMPLETIONS}")
    if request.get("method", "POST") != "POST" or not isinstance(body, dict):
        raise BadRequest("a request is a POST with a JSON object body")
    if url == CHAT and not (isinstance(body.get("messages"), list) and body["messages"]):
        raise BadRequest("a chat completion needs a non-empty messages list")
    if url == COMPLETIONS and not isinstance(body.get("prompt"), str):
        raise BadRequest("a completion needs a prompt string (lists of prompts are not served)")
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - NEUTRAL_FIELDS)
    if unknown:
        raise BadRequest(f"body fields not served: {', '.join(unknown)}")
    if body.get("stream"):
        raise BadRequest("stream=true has no meaning in a batch file")
    try:
        params = SamplingParams(**{SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS})
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None
    return BatchRequest(line_number, request["custom_id"], url, body, params)


def output_line(request: BatchRequest, output: RequestOutput, model: str) -> dict:
    """The OpenAI batch output entry of a served request; its `model` is the request's (as vLLM's server echoes it),
    else `model` (the served model name)."""
    usage = {"prompt_tokens": len(output.prompt_token_ids),
             "completion_tokens": sum(len(c.token_ids) for c in output.outputs)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if request.url == CHAT:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": None} for c in output.outputs]
        body = {"id": f"chatcmpl-{request.line}", "object": "chat.completion"}
    else:
        choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                   for c in output.outputs]
        body = {"id": f"cmpl-{request.line}", "object": "text_completion"}
    body.update(created=int(time.time()), model=request.body.get("model") or model, choices=choices, usage=usage)
    return {"id": f"batch_req_{request.line}", "custom_id": request.custom_id,
            "response": {"status_code": 200, "request_id": body["id"], "body": body}, "error": None}


def error_line(line_number: int, custom_id: str | None, message: str) -> dict:
    """The entry of a request that was not served, with its line in the input file."""
    return {"id": f"batch_req_{line_number}", "custom_id": custom_id, "response": None, "line": line_number,
            "error": {"code": "invalid_request", "message": message}}
