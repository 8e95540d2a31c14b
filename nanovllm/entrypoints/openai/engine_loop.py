"""The server's one engine loop: a thread that steps the engine while any request is unfinished, so that requests
arriving at any time join the running batches and leave them when done. Handlers (on the asyncio loop) submit a
request and read its progress from a queue, one snapshot a step: every completion's text and token ids so far.
Nothing but this thread touches the engine after start-up; adds and aborts reach it through its inbox."""
import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass

from nanovllm.logger import logger
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while it runs
    logprobs: tuple | None = None  # a dict (token id -> Logprob) a token, where the request asked for them


@dataclass(frozen=True)
class Progress:
    """One request after a step: its completions so far, or the error that ended it."""

    completions: tuple[Completion, ...] = ()
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(c.finish_reason is not None for c in self.completions)


class RequestStream:
    """A request's progress as the engine loop reports it, read by one handler on the asyncio loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id, self.loop = request_id, loop
        self.queue: asyncio.Queue[Progress] = asyncio.Queue()

    def put(self, progress: Progress):  # from the engine loop's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, progress)

    async def __aiter__(self):
        while True:
            progress = await self.queue.get()
            yield progress
            if progress.finished:
                return

    async def last(self) -> Progress:
        """The request's final progress: its whole answer, or its error."""
        progress = Progress()
        async for progress in self:
            pass
        return progress


class EngineLoop:
    def __init__(self, llm):
        self.llm, self.engine = llm, llm.llm_engine
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, RequestStream] = {}
        self.ids = itertools.count()
        self.closed = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="nanovllm-engine-loop")
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (already validated: validate_prompt) and return its stream."""
        stream = RequestStream(f"srv-{next(self.ids)}", asyncio.get_running_loop())
        self.inbox.put(("add", stream, prompt_ids, params))
        return stream

    def abort(self, stream: RequestStream):
        """Stop a request (its client went away) and free its blocks."""
        self.inbox.put(("abort", stream, None, None))

    def close(self):
        self.closed = True
        self.inbox.put(("close", None, None, None))
        self.thread.join(timeout=10)

    def _run(self):
        while not self.closed:
            busy = self.engine.has_unfinished_requests() or self.engine._in_flight is not None
            self._take_inbox(block=not busy)
            if not (self.engine.has_unfinished_requests() or self.engine._in_flight is not None):
                continue
            try:
                finished = {out.request_id: out for out in self.engine.step()}
            except Exception as e:  # noqa: BLE001 - the step's requests fail with it; the loop serves the next ones
                logger.exception("an engine step failed")
                self._fail_all(f"the engine step failed: {e}")
                continue
            for request_id, stream in list(self.streams.items()):
                progress = self._progress(request_id, finished.get(request_id))
                if progress is not None:
                    stream.put(progress)
                    if progress.finished:
                        del self.streams[request_id]

    def _take_inbox(self, block: bool):
        while True:
            try:
                kind, stream, prompt_ids, params = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                try:
                    self.engine.add_request(stream.request_id, prompt_ids, params)
                    self.streams[stream.request_id] = stream
                except ValueError as e:
                    stream.put(Progress(error=str(e)))
            elif kind == "abort" and self.streams.pop(stream.request_id, None) is not None:
                self.engine.abort_request(stream.request_id)

    def _progress(self, request_id: str, output) -> Progress | None:
        if output is not None:
            return Progress(tuple(Completion(c.text, tuple(c.token_ids), c.finish_reason,
                                             tuple(c.logprobs) if c.logprobs is not None else None)
                                  for c in output.outputs),
                            len(output.prompt_token_ids))
        request = self.engine.requests.get(request_id)
        if request is None:
            return None
        return Progress(tuple(Completion(s.text, tuple(s.sampled_token_ids), s.finish_reason,
                                         tuple(s.output_logprobs) if s.params.logprobs is not None else None)
                              for s in request.seqs),
                        len(request.prompt_token_ids))

    def _fail_all(self, message: str):
        for request_id, stream in list(self.streams.items()):
            self.engine.abort_request(request_id)
            stream.put(Progress(error=message))
        self.streams.clear()
