"""The server's one engine loop: a thread that steps the engine while any request is unfinished, so that requests
arriving at any time join the running batches and leave them when done. Handlers (on the asyncio loop) submit a
request and read its progress from a queue: every completion's text and tokens so far, as views of the engine's own
lists (no copy a step), all of a step's updates handed to the asyncio loop at once. A handler that falls behind
reads only the newest update. Nothing but this thread touches the engine after start-up; adds and aborts reach it
through its inbox."""
import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass

from nanovllm.logger import logger
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    """A completion as one step left it: num_tokens tokens from ids[first] on. The engine's lists change only past
    the tokens it has read back, so a view of them needs no copy."""

    text: str
    ids: list[int]
    first: int
    num_tokens: int
    finish_reason: str | None  # None while it runs
    all_logprobs: list | None = None  # a dict (token id -> Logprob) a token, where the request asked for them

    @property
    def token_ids(self) -> list[int]:
        return self.tokens_from(0)[0]

    @property
    def logprobs(self) -> list | None:
        return self.tokens_from(0)[1]

    def tokens_from(self, start: int) -> tuple[list[int], list | None]:
        """(token ids, their logprobs or None) from the completion's start-th token on."""
        logprobs = None if self.all_logprobs is None else self.all_logprobs[start:self.num_tokens]
        return self.ids[self.first + start:self.first + self.num_tokens], logprobs


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

    async def __aiter__(self):
        """Each update, or where several wait, the newest (each holds everything before it)."""
        while True:
            progress = await self.queue.get()
            while not self.queue.empty():
                progress = self.queue.get_nowait()
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
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the server's, where the streams are read
        self.thread = threading.Thread(target=self._run, daemon=True, name="nanovllm-engine-loop")
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (already validated: validate_prompt) and return its stream."""
        stream = RequestStream(f"srv-{next(self.ids)}", asyncio.get_running_loop())
        self.event_loop = stream.loop
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
            updates = []
            for request_id, stream in list(self.streams.items()):
                progress = self._progress(request_id, finished.get(request_id))
                if progress is not None:
                    updates.append((stream, progress))
                    if progress.finished:
                        del self.streams[request_id]
            self._deliver(updates)

    def _deliver(self, updates: list[tuple[RequestStream, Progress]]):
        """One wake-up of the asyncio loop for all of a step's updates."""
        if updates:
            self.event_loop.call_soon_threadsafe(_put_all, updates)

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
                    self._deliver([(stream, Progress(error=str(e)))])
            elif kind == "abort" and self.streams.pop(stream.request_id, None) is not None:
                self.engine.abort_request(stream.request_id)

    def _progress(self, request_id: str, output) -> Progress | None:
        if output is not None:
            return Progress(tuple(Completion(c.text, c.token_ids, 0, len(c.token_ids), c.finish_reason, c.logprobs)
                                  for c in output.outputs),
                            len(output.prompt_token_ids))
        request = self.engine.requests.get(request_id)
        if request is None:
            return None
        return Progress(tuple(Completion(s.text, s.token_ids, s.num_prompt_tokens,
                                         len(s.token_ids) - s.num_prompt_tokens - s.num_placeholders, s.finish_reason,
                                         s.output_logprobs if s.params.logprobs is not None else None)
                              for s in request.seqs),
                        len(request.prompt_token_ids))

    def _fail_all(self, message: str):
        for request_id in self.streams:
            self.engine.abort_request(request_id)
        self._deliver([(stream, Progress(error=message)) for stream in self.streams.values()])
        self.streams.clear()


def _put_all(updates: list[tuple[RequestStream, Progress]]):
    for stream, progress in updates:
        stream.queue.put_nowait(progress)
