"""Ollama's API beside the OpenAI one (nanovllm serve): /api/generate and /api/chat (a stream of NDJSON lines by
default, one JSON object with "stream": false), /api/tags and /api/show. `options` maps to SamplingParams
(num_predict, temperature, top_p, top_k, min_p, seed, stop, repeat_penalty, presence_penalty, frequency_penalty).
Requests join the same engine loop as the OpenAI routes; errors are Ollama's {"error": message}."""
import json
import time
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nanovllm.entrypoints.openai.engine_client import EngineClient, Progress, RequestStream
from nanovllm.entrypoints.request_body import json_object
from nanovllm.sampling_params import SamplingParams

OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


class OllamaError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def add_ollama_routes(app: FastAPI, engine: EngineClient, served_model: str):
    @app.exception_handler(OllamaError)
    async def ollama_error(_, e: OllamaError):
        return JSONResponse({"error": e.message}, e.status)

    @app.get("/api/tags")
    async def tags():
        return {"models": [{"name": served_model, "model": served_model, "modified_at": _now(), "size": 0,
                            "digest": "", "details": _details(engine.info)}]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await _body(request, served_model)
        return {"modelfile": "", "parameters": "", "template": "", "details": _details(engine.info),
                "model_info": {"general.architecture": engine.info["architecture"],
                               "context_length": engine.info["max_model_len"]},
                "name": body.get("model") or body.get("name")}

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await _body(request, served_model)
        if not isinstance(body.get("prompt"), str):
            raise OllamaError(400, "prompt must be a string")
        prompt = body["prompt"] if not body.get("system") else f"{body['system']}\n\n{body['prompt']}"
        return await _serve(engine, body, ("text", prompt), chat=False, model=served_model)

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await _body(request, served_model)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OllamaError(400, "messages must be a non-empty list")
        return await _serve(engine, body, ("chat", messages), chat=True, model=served_model)


async def _body(request: Request, served_model: str) -> dict:
    body = await json_object(request, lambda message: OllamaError(400, message))
    model = body.get("model") or body.get("name")
    if model not in (None, served_model):
        raise OllamaError(404, f"model {model!r} not found: this server serves {served_model!r}")
    return body


def _sampling_params(options: dict) -> SamplingParams:
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise OllamaError(400, f"options not served: {', '.join(unknown)}")
    fields = {OPTIONS[k]: v for k, v in options.items() if v is not None}
    if fields.get("max_tokens") == -1:  # Ollama's "until the context is full"
        fields["max_tokens"] = None
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise OllamaError(400, str(e)) from None


async def _serve(engine: EngineClient, body: dict, prompt: tuple, chat: bool, model: str):
    params = _sampling_params(body.get("options") or {})
    started = time.monotonic_ns()
    try:
        stream, accepted = await engine.start(prompt, params)
    except RuntimeError as e:  # the engine process is gone
        raise OllamaError(503, str(e)) from None
    if accepted.error is not None:
        raise OllamaError(400, accepted.error)
    if body.get("stream", True):
        return StreamingResponse(_lines(engine, stream, chat, model, accepted.prompt_tokens, started),
                                 media_type="application/x-ndjson")
    progress = await stream.last()
    if progress.error is not None:
        raise OllamaError(400, progress.error)
    return _line(chat, model, progress.completions[0].text, progress, accepted.prompt_tokens, started, final=True)


def _line(chat: bool, model: str, text: str, progress: Progress, prompt_tokens: int, started: int,
          final: bool = False) -> dict:
    line = {"model": model, "created_at": _now()}
    line.update({"message": {"role": "assistant", "content": text}} if chat else {"response": text})
    line["done"] = final
    if final:
        reason = progress.completions[0].finish_reason
        line.update(done_reason="length" if reason == "length" else "stop", total_duration=time.monotonic_ns() - started,
                    prompt_eval_count=prompt_tokens, eval_count=progress.completions[0].num_tokens)
    return line


async def _lines(engine: EngineClient, stream: RequestStream, chat: bool, model: str, prompt_tokens: int,
                 started: int):
    """NDJSON: a line a step with the text it added, then the final line with the counts. A client that goes away
    aborts the request."""
    sent, finished = 0, False
    try:
        async for progress in stream:
            if progress.error is not None:
                yield json.dumps({"error": progress.error}) + "\n"
                break
            completion = progress.completions[0]
            if completion.finish_reason is not None:
                if completion.text[sent:]:
                    yield json.dumps(_line(chat, model, completion.text[sent:], progress, prompt_tokens, started)) + "\n"
                yield json.dumps(_line(chat, model, "", progress, prompt_tokens, started, final=True)) + "\n"
            elif len(completion.text) > sent:
                yield json.dumps(_line(chat, model, completion.text[sent:], progress, prompt_tokens, started)) + "\n"
                sent = len(completion.text)
        finished = True
    finally:
        if not finished:
            engine.abort(stream)


def _details(info: dict) -> dict:
    return {"format": info["format"], "family": info["model_type"], "families": [info["model_type"]],
            "parameter_size": "", "quantization_level": info["quantization"]}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
