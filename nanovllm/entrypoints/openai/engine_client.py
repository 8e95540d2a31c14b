"""The server's side of the engine process (engine_loop.py): it starts the process, sends it commands, and adds the
deltas sent after each step to each request's stream, which the request's handler reads on the asyncio loop. A
thread waits on the pipe and hands each step's message to the asyncio loop in one wake-up; a step only appends to
each stream and wakes its handler, which takes a snapshot of everything so far when it runs (so a handler that falls
behind skips to the newest, and a step costs the server little). An engine process that exits ends every request
with an error."""
import asyncio
import itertools
import multiprocessing
import queue
import threading
from dataclasses import dataclass

from nanovllm.entrypoints.openai.engine_loop import run_engine_process
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    """A completion as far as a step took it: its first num_tokens tokens (the lists only grow, so a view of them
    needs no copy)."""

    text: str
    ids: list[int]
    num_tokens: int
    finish_reason: str | None  # None while it runs
    all_logprobs: list | None = None  # a dict (token id -> Logprob) a token, where the request asked for them

    def tokens_from(self, start: int) -> tuple[list[int], list | None]:
        """(token ids, their logprobs or None) from the start-th on."""
        logprobs = None if self.all_logprobs is None else self.all_logprobs[start:self.num_tokens]
        return self.ids[start:self.num_tokens], logprobs


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
    """A request's progress, read by one handler on the asyncio loop: first its acceptance, then each step's."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.texts = [""] * params.n
        self.ids: list[list[int]] = [[] for _ in range(params.n)]
        self.logprobs: list[list] | None = [[] for _ in range(params.n)] if params.logprobs is not None else None
        self.reasons: list[str | None] = [None] * params.n
        self.prompt_tokens = 0
        self.error: str | None = None
        self.finished = False
        self.deltas = 0  # deltas applied; the first is the acceptance
        self.read = 0  # deltas the handler has seen
        self.changed = asyncio.Event()

    def apply(self, delta: tuple):
        """Add one delta (engine_loop's layout) and wake the handler."""
        _, completions, prompt_tokens, error = delta
        self.deltas += 1
        self.changed.set()
        if error is not None:
            self.error, self.finished = error, True
            return
        self.prompt_tokens = self.prompt_tokens or prompt_tokens
        for i, (text, token_ids, logprobs, reason) in enumerate(completions):
            self.texts[i] += text
            self.ids[i] += token_ids
            if self.logprobs is not None and logprobs is not None:
                self.logprobs[i] += logprobs
            self.reasons[i] = reason
        self.finished = bool(completions) and all(r is not None for r in self.reasons)

    def progress(self) -> Progress:
        """A snapshot of everything so far."""
        if self.error is not None:
            return Progress(error=self.error)
        return Progress(tuple(Completion(self.texts[i], self.ids[i], len(self.ids[i]), self.reasons[i],
                                         self.logprobs[i] if self.logprobs is not None else None)
                              for i in range(len(self.texts))), self.prompt_tokens)

    async def _wait(self, past: int):
        while self.deltas <= past:
            self.changed.clear()
            await self.changed.wait()

    async def accepted(self) -> Progress:
        """The first progress: the prompt's token count, or the error that refused it."""
        await self._wait(0)
        self.read = 1
        return Progress(error=self.error) if self.error is not None else Progress(prompt_tokens=self.prompt_tokens)

    async def __aiter__(self):
        """The progress after each wake-up past acceptance: everything so far, however many steps it spans."""
        while True:
            await self._wait(self.read)
            self.read = self.deltas
            progress = self.progress()
            yield progress
            if progress.finished:
                return

    async def last(self) -> Progress:
        """The request's final progress: its whole answer, or its error."""
        progress = Progress()
        async for progress in self:
            pass
        return progress


class EngineClient:
    def __init__(self, model: str, engine_kwargs: dict):
        """Start the engine process on model with LLM's keywords; returns once it serves (raises if it cannot)."""
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=run_engine_process, args=(model, engine_kwargs, child), daemon=True,
                                       name="nanovllm-engine")
        self.process.start()
        child.close()
        try:
            info = self.conn.recv()
        except EOFError:
            info = {"error": f"the engine process exited with code {self.process.exitcode}"}
        if "error" in info:
            self.process.join(timeout=10)
            raise RuntimeError(f"the engine did not start: {info['error']}")
        self.info = info  # engine_loop.engine_info: what the routes show of the model
        self.streams: dict[str, RequestStream] = {}
        self.ids = itertools.count()
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the server's, where the streams are read
        self.replies: queue.Queue = queue.Queue()  # answers to stats()
        self.send_lock, self.stats_lock = threading.Lock(), threading.Lock()
        self.dead: str | None = None  # why the engine process is gone
        threading.Thread(target=self._receive, daemon=True, name="nanovllm-engine-replies").start()

    def submit(self, prompt: tuple, params: SamplingParams) -> RequestStream:
        """Queue a request: prompt ("ids", token ids), ("text", str) or ("chat", messages)."""
        if self.dead is not None:
            raise RuntimeError(self.dead)
        self.event_loop = asyncio.get_running_loop()
        stream = RequestStream(f"srv-{next(self.ids)}", params)
        self.streams[stream.request_id] = stream
        self._send(("add", stream.request_id, prompt, params))
        return stream

    async def start(self, prompt: tuple, params: SamplingParams) -> tuple[RequestStream, Progress]:
        """submit(), then wait for the engine to take the request (its prompt's token count) or refuse it (an
        error)."""
        stream = self.submit(prompt, params)
        return stream, await stream.accepted()

    def abort(self, stream: RequestStream):
        """Stop a request (its client went away) and free its blocks."""
        if self.streams.pop(stream.request_id, None) is not None:
            self._send(("abort", stream.request_id))

    def stats(self) -> dict:
        """The engine's: unfinished requests (bool), the most sequences a step ran, free and all KV blocks, steps run,
        the seconds spent in them and the engine process's CPU seconds."""
        with self.stats_lock:
            self._send(("stats",))
            return self.replies.get(timeout=60)

    def close(self):
        self.dead = "the server is shutting down"
        if self.process.is_alive():
            self._send(("close",))
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()

    def _send(self, command: tuple):
        with self.send_lock:
            try:
                self.conn.send(command)
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(self.dead or f"the engine process is gone: {e}") from None

    def _receive(self):
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if self.dead is None:  # not closed by the server: the process died
                    self.dead = f"the engine process exited (code {self.process.exitcode})"
                    if self.event_loop is not None and not self.event_loop.is_closed():
                        self.event_loop.call_soon_threadsafe(self._fail_all)
                return
            if isinstance(message, dict):
                self.replies.put(message)
            else:
                self.event_loop.call_soon_threadsafe(self._apply, message)

    def _apply(self, deltas: list[tuple]):
        for delta in deltas:
            stream = self.streams.get(delta[0])
            if stream is not None:
                stream.apply(delta)
                if stream.finished:
                    del self.streams[delta[0]]

    def _fail_all(self):
        for stream in self.streams.values():
            stream.apply((stream.request_id, (), 0, self.dead))
        self.streams.clear()
