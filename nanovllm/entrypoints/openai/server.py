"""`nanovllm serve MODEL` (vLLM's `vllm serve`): the OpenAI API over one engine, on FastAPI + uvicorn, and Ollama's
beside it (entrypoints/ollama.py).

Routes: /v1/completions and /v1/chat/completions (`stream` as server-sent events, `stream_options.include_usage`),
/v1/models, /health. Every request joins the engine's running batches through one engine loop, which runs in a
process of its own (entrypoints/openai/engine_loop.py, engine_client.py); a client that goes away mid-stream aborts
its request. With --api-key (or
NANOVLLM_API_KEY) every /v1 and /api route needs `Authorization: Bearer KEY`; without one the server binds 127.0.0.1 unless
--host says otherwise. Errors are OpenAI's JSON: {"error": {"message", "type", "param", "code"}}."""
import hmac
import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from nanovllm.entrypoints.ollama import add_ollama_routes
from nanovllm.entrypoints.openai.engine_client import EngineClient, Progress, RequestStream
from nanovllm.entrypoints.openai_batch import SAMPLING_FIELDS
from nanovllm.entrypoints.request_body import json_object
from nanovllm.logger import logger
from nanovllm.sampling_params import SamplingParams

CHAT_FIELDS = {"model", "messages", "stream", "stream_options", "user", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = {"model", "prompt", "stream", "stream_options", "user", "logprobs"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def build_app(engine: EngineClient, served_model: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="nanovllm")

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith(("/v1", "/api")):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", kind="authentication_error")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return _error(e.status, e.message, e.param, e.kind)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return _error(e.status_code, str(e.detail), kind="not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        return _error(400, f"the request body is not valid JSON: {e.errors()[:1]}")

    add_ollama_routes(app, engine, served_model)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": int(time.time()),
                                            "owned_by": "nanovllm", "max_model_len": engine.info["max_model_len"]}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, COMPLETION_FIELDS, served_model)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = ("ids", prompt)
        elif isinstance(prompt, str):
            prompt = ("text", prompt)
        else:
            raise APIError(400, "prompt must be a string or a list of token ids", "prompt")
        return await _serve(engine, body, prompt, chat=False, model=served_model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request, CHAT_FIELDS, served_model)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        return await _serve(engine, body, ("chat", messages), chat=True, model=served_model)

    return app


async def _body(request: Request, extra_fields: set, served_model: str) -> dict:
    body = await json_object(request, lambda message: APIError(400, message))
    unknown = sorted(set(body) - set(SAMPLING_FIELDS) - extra_fields)
    if unknown:
        raise APIError(400, f"fields not served: {', '.join(unknown)}", unknown[0])
    if body.get("model", served_model) != served_model:
        raise APIError(404, f"the model {body['model']!r} does not exist: this server serves {served_model!r}", "model",
                       "not_found_error")
    return body


def _sampling_params(body: dict, chat: bool) -> SamplingParams:
    fields = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    logprobs = body.get("logprobs")
    if chat and logprobs:  # chat: logprobs true, and top_logprobs alternatives a token
        fields["logprobs"] = body.get("top_logprobs") or 0
    elif not chat and logprobs is not None:  # completions: logprobs = how many alternatives
        fields["logprobs"] = logprobs
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), next((k for k in body if k in SAMPLING_FIELDS and k in str(e)), None)) from None


async def _serve(engine: EngineClient, body: dict, prompt: tuple, chat: bool, model: str):
    params = _sampling_params(body, chat)
    try:
        stream, accepted = await engine.start(prompt, params)
    except RuntimeError as e:  # the engine process is gone
        raise APIError(503, str(e), kind="server_error") from None
    if accepted.error is not None:
        raise APIError(400, accepted.error, "messages" if chat else "prompt")
    reply = _Reply(chat, model, accepted.prompt_tokens, params)
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_events(engine, stream, reply, include_usage), media_type="text/event-stream")
    progress = await stream.last()
    if progress.error is not None:
        raise APIError(400, progress.error)
    return reply.whole(progress)


class _Reply:
    """The OpenAI JSON of one request: the whole answer, or its stream's chunks (text deltas a completion)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, params: SamplingParams):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent = [0] * params.n  # characters streamed a completion
        self.done = [False] * params.n
        self.sent_tokens = [0] * params.n  # tokens whose logprobs went out, a completion
        self.top = params.logprobs or 0  # alternatives a token in the logprobs

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, progress: Progress) -> dict:
        completion = sum(c.num_tokens for c in progress.completions)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def whole(self, progress: Progress) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": _chat_logprobs(*c.tokens_from(0), self.top), "finish_reason": c.finish_reason}
                       for i, c in enumerate(progress.completions)]
        else:
            choices = [{"index": i, "text": c.text, "logprobs": _completion_logprobs(*c.tokens_from(0), self.top),
                        "finish_reason": c.finish_reason} for i, c in enumerate(progress.completions)]
        return {**self._head(False), "choices": choices, "usage": self.usage(progress)}

    def chunks(self, progress: Progress) -> list[dict]:
        """The text each completion gained since the last chunk (all of it once it finished)."""
        out = []
        for i, c in enumerate(progress.completions):
            if self.done[i]:
                continue
            delta, self.sent[i] = c.text[self.sent[i]:], len(c.text)
            self.done[i] = c.finish_reason is not None
            if not delta and not self.done[i]:
                continue
            new = c.tokens_from(self.sent_tokens[i])  # (token ids, logprobs or None) since the last chunk
            self.sent_tokens[i] = c.num_tokens
            if self.chat:
                choice = {"index": i, "delta": {"content": delta} if delta else {},
                          "logprobs": _chat_logprobs(*new, self.top), "finish_reason": c.finish_reason}
            else:
                choice = {"index": i, "text": delta, "logprobs": _completion_logprobs(*new, self.top),
                          "finish_reason": c.finish_reason}
            out.append({**self._head(True), "choices": [choice]})
        return out


def _token_logprobs(token_ids: list[int], logprobs: list, k: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, its logprob, the k most likely tokens by rank) of each sampled token."""
    out = []
    for token_id, entry in zip(token_ids, logprobs):
        top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        out.append((entry[token_id].decoded_token or "", entry[token_id].logprob,
                    [(lp.decoded_token or "", lp.logprob) for lp in top]))
    return out


def _chat_logprobs(token_ids: list[int], logprobs: list | None, k: int) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [{"token": token, "logprob": logprob, "bytes": list(token.encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]}
                        for token, logprob, top in _token_logprobs(token_ids, logprobs, k)]}


def _completion_logprobs(token_ids: list[int], logprobs: list | None, k: int) -> dict | None:
    if logprobs is None:
        return None
    entries = _token_logprobs(token_ids, logprobs, k)
    offsets, at = [], 0
    for token, _, _ in entries:
        offsets.append(at)
        at += len(token)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}


async def _events(engine: EngineClient, stream: RequestStream, reply: _Reply, include_usage: bool):
    """Server-sent events: the chat role first, then the deltas as the steps produce them, [DONE] last. A client that
    goes away (the generator is closed) aborts the request."""
    finished = False
    try:
        if reply.chat:
            first = {**reply._head(True), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}
                                                      for i in range(len(reply.sent))]}
            yield f"data: {json.dumps(first)}\n\n"
        progress = Progress()
        async for progress in stream:
            if progress.error is not None:
                yield f"data: {json.dumps({'error': {'message': progress.error, 'type': 'invalid_request_error'}})}\n\n"
                break
            for chunk in reply.chunks(progress):
                yield f"data: {json.dumps(chunk)}\n\n"
        finished = True
        if include_usage and progress.error is None:
            yield f"data: {json.dumps({**reply._head(True), 'choices': [], 'usage': reply.usage(progress)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            engine.abort(stream)


def serve(args) -> int:
    """Run the server until interrupted."""
    import uvicorn

    from nanovllm.entrypoints.engine_flags import engine_kwargs

    api_key = args.api_key or os.environ.get("NANOVLLM_API_KEY")
    host = args.host or ("0.0.0.0" if api_key else "127.0.0.1")
    if api_key is None and args.host is None:
        logger.info("no --api-key: serving on 127.0.0.1 only (pass --host to listen elsewhere)")
    engine = EngineClient(args.model, engine_kwargs(args))
    try:
        uvicorn.run(build_app(engine, args.served_model_name or args.model, api_key), host=host, port=args.port,
                    log_level="warning")
    finally:
        engine.close()
    return 0
